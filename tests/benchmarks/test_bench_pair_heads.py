"""The pair view of ``bench_pair_heads``: two kv heads of D as one of 2D, with a block-diagonal
query, gives every query row its own head's attention (dense fp32 reference, CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_pair_heads import pair_views, second_half  # noqa: E402

from torch_kvq.attention.kernels.reference import ref_attention  # noqa: E402


@pytest.mark.parametrize("qh,kh,d", [(32, 8, 128), (8, 2, 64), (4, 4, 16)])
def test_pair_view_attention_equals_per_head_attention(qh, kh, d) -> None:
    g = torch.Generator().manual_seed(0)
    b, pages, page = 3, 5, 16
    cache = torch.randn(pages, 2, page, kh, d, generator=g)
    q = torch.randn(b, qh, d, generator=g)
    k, v = (cache[:, i].reshape(-1, kh, d) for i in (0, 1))
    pos = torch.arange(k.shape[0])
    ref = ref_attention(q, k, v, pos[-1:].expand(b), pos, d**-0.5)
    q2, cache2, fill, pick = pair_views(q, cache, kh)
    fill()
    assert cache2.data_ptr() == cache.data_ptr()
    assert cache2.shape == (pages, 2, page, kh // 2, 2 * d)
    k2, v2 = (cache2[:, i].reshape(-1, kh // 2, 2 * d) for i in (0, 1))
    out2 = ref_attention(q2, k2, v2, pos[-1:].expand(b), pos, d**-0.5)
    out = pick(out2, torch.empty_like(q))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the discarded halves are the other head's V under this row's weights: not the answer
    assert not torch.allclose(out2[..., :d].view(b, kh // 2, 2, -1, d)[:, :, 1],
                              ref.view(b, kh // 2, 2, -1, d)[:, :, 1])  # fmt: skip


def test_second_half_reads_the_late_samples() -> None:
    # samples: [t_s, sm_mhz, mem_mhz, power_w, reason_mask]; 0x4 is sw_power_cap
    samples = [[0.0, 1980, 3201, 400.0, 0], [1.0, 1900, 3201, 690.0, 4], [2.0, 1650, 3201, 699.0, 4],
               [3.0, 1680, 3201, 697.0, 4]]  # fmt: skip
    got = second_half({"n": 4, "samples": samples, "reasons_share": {"sw_power_cap": 0.75}})
    assert got == {"sm_mhz_median_second_half": 1665.0, "mem_mhz_second_half": [3201],
                   "power_w_median_second_half": 698.0, "power_cap_share": 0.75}  # fmt: skip
    unavailable = {"available": False, "why": "not on CUDA"}
    assert second_half(unavailable) == {"clocks": unavailable}


def test_sustained_divides_by_the_calls_of_each_half(monkeypatch) -> None:
    import bench_pair_heads

    seen = []

    def fake(step, reps):
        seen.append(reps)
        return 90.0, 50.0, {"power_cap_share": 1.0}

    monkeypatch.setattr(bench_pair_heads, "back_to_back", fake)
    got = bench_pair_heads.sustained(lambda: None, calls=20, ms_per_call=0.5, seconds=0.9)
    assert seen == [90]  # 0.9 s / (20 calls x 0.5 ms)
    assert got == {"reps": 90, "ms_per_call": 90.0 / 1800, "ms_per_call_second_half": 50.0 / 900,
                   "power_cap_share": 1.0}  # fmt: skip
