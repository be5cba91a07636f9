"""The TMA decode (split grid and balanced schedule) reading a ``k8v4_per_token_head`` cache in
place: uint8 [P, 3, page, KH, D / 2], k's int8 codes as bytes in slots 0 / 1 and v's packed
rotated int4 codes in slot 2 (``tests.support.triton_case.quantize_pages``: the aten write's
layout), fp32 scales (v's with the zero point in its low bits); q not rotated, the output
un-rotated in the epilogue (``attention/triton/k8v4.py``), against fp32 attention over the cache
dequantized (k ``code * scale``, v un-rotated: ``quant.dequantize_k8v4_pages``).

CPU: Triton's interpreter (fp32 products; fp16 too). GPU: the compiled kernel at its defaults
(fp16 products), both schedules, long contexts, CUDA-graph replay. Without Triton every test here
skips.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_case import HAS_CUDA, LENS, ScaledCase, dense_table, rel_err, run_tma
from torch_kvq.attention.triton import decode_config

triton = pytest.importorskip("triton")  # after triton_case, which sets the interpreter first


def _case(lens, qh, kh, d, page=16, device="cpu", seed=0, **gain) -> ScaledCase:
    return ScaledCase(lens, qh, kh, d, "k8v4", page=page, device=device, seed=seed, **gain)


def test_case_is_a_k8v4_cache() -> None:
    """The cases' caches: 3 slots of D / 2 bytes, k's int8 codes split over slots 0 and 1."""
    from torch_kvq.attention import quant

    case = _case((5, 40), 8, 2, 64)
    assert case.kv_cache.dtype == torch.uint8 and case.kv_cache.shape[1:] == (3, 16, 2, 32)
    ids = torch.arange(case.kv_cache.shape[0])
    pages = case.pages(ids)
    k_scale = case.kv_scale[:, 0].transpose(1, 2)[..., None]  # [P, page, KH, 1]
    assert torch.equal(pages[:, 0], quant.k8v4_k_codes(case.kv_cache[:, :2]).float() * k_scale)


# (qh, kh, d): GQA groups 1, 4 and 8 at heads 64, 128, 256
SHAPES = [(4, 4, 64), (8, 2, 128), (16, 2, 256)]


@pytest.mark.parametrize("qh,kh,d", SHAPES, ids=["g1_d64", "g4_d128", "g8_d256"])
@pytest.mark.parametrize(
    "window,soft_cap,ppi,num_splits,lazy",
    [(None, None, 1, 1, True), (100, 5.0, 2, 3, False), (None, 5.0, 4, 2, True)],
    ids=["global_1split", "swa_cap_3splits_ppi2", "cap_2splits_ppi4"],
)
def test_interpreter_split_grid_matches_reference(
    interp, qh, kh, d, window, soft_cap, ppi, num_splits, lazy
) -> None:
    case = _case(LENS, qh, kh, d, seed=ppi)
    out = torch.empty(case.q.shape, dtype=torch.float32)
    kw = dict(window=window, soft_cap=soft_cap, dot_dtype=torch.float32, pages_per_iter=ppi)
    run_tma(case, interp, out=out, num_splits=num_splits, lazy_rescale=lazy, **kw)
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-4, f"rel err {err:.2e}"


@pytest.mark.parametrize("page", [32, 64])
def test_interpreter_larger_pages(interp, page: int) -> None:
    """Pages of 32 and 64 tokens: the three boxes' rows and the scale vectors follow the size."""
    case = _case((1, 31, 65, 200), 8, 2, 64, page=page, seed=page)
    out = torch.empty(case.q.shape, dtype=torch.float32)
    run_tma(case, interp, out=out, num_splits=2, dot_dtype=torch.float32, window=50)
    err = rel_err(out, case.ref(50))
    assert err < 5e-4, f"rel err {err:.2e}"


@pytest.mark.parametrize("nprog", [1, 5, 300])  # 300: more programs than the 174 pages
@pytest.mark.parametrize("window,soft_cap", [(None, None), (100, 5.0)], ids=["global", "swa_cap"])
def test_interpreter_balanced_matches_reference(interp, programs, nprog, window, soft_cap):
    """The balanced schedule: whole pairs written un-rotated by their program, cut pairs'
    partials un-rotated before ``_combine_balanced`` merges them."""
    programs(nprog)
    case = _case((1, 15, 16, 17, 300, 1000), 8, 2, 128, seed=nprog)
    out = torch.full(case.q.shape, float("nan"), dtype=torch.float32)
    kw = dict(window=window, soft_cap=soft_cap, dot_dtype=torch.float32, programs_per_sm=1)
    run_tma(case, interp, out=out, **kw)
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-4, f"rel err {err:.2e}"  # NaN (a pair never written) fails too


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("gain", [1e-3, 1.0, 300.0])
def test_interpreter_fp16_products(interp, lazy, gain) -> None:
    """fp16 products (the GPU default): k's bytes widened to fp16 by the exponent trick, v's
    nibbles centred, the v scales times 2^pv_shift, the epilogue's fp16 un-rotation: accurate
    for K and V heads from 1e-3 to 300."""
    case = _case((1, 17, 1000), 8, 2, 64, seed=4, v_gain=gain, k_gain=min(gain, 3.0))
    out = torch.empty(case.q.shape, dtype=torch.float32)
    run_tma(case, interp, out=out, num_splits=2, dot_dtype=torch.float16, lazy_rescale=lazy)
    assert torch.isfinite(out).all()
    err = rel_err(out, case.ref())
    assert err < 2e-3, f"rel err {err:.2e}"


def test_interpreter_k8v4_is_not_read_as_int4(interp) -> None:
    """The slot dim tells the caches apart: the same bytes' first two slots as an int4 cache
    give int4's attention (another answer), and 3 slots of int8 or of the wrong width are
    refused, never read."""
    case = _case((5, 40), 8, 2, 64)
    as_int4 = case.kv_cache[:, 1:].contiguous()  # 2 slots of uint8: read as int4
    table = dense_table(case)
    args = (case.q, as_int4, table, case.seq_lens, 1.0, 1.0, case.sm_scale)
    out = interp.paged_decode_tma(*args, max_seq_len=40, kv_scale=case.kv_scale,
                                  dot_dtype=torch.float32)  # fmt: skip
    assert rel_err(out, case.ref()) > 0.1
    with pytest.raises(ValueError, match=r"need kv_cache \[P, 2, page, KH, D\]"):
        int8 = case.kv_cache.view(torch.int8)
        interp.paged_decode_tma(case.q, int8, table, case.seq_lens, 1.0, 1.0, 1.0,
                                max_seq_len=40, kv_scale=case.kv_scale)  # fmt: skip
    with pytest.raises(ValueError, match=r"k8v4_per_token_head's \(3\), D / 2 bytes a head: "
                       r"its last dim must be head_dim / 2 = 32"):  # fmt: skip
        wide = torch.zeros((*case.kv_cache.shape[:-1], 64), dtype=torch.uint8)
        interp.paged_decode_tma(case.q, wide, table, case.seq_lens, 1.0, 1.0, 1.0,
                                max_seq_len=40, kv_scale=case.kv_scale)  # fmt: skip
    with pytest.raises(ValueError, match=r"a uint8 \(k8v4_per_token_head\) cache needs its"):
        run_tma(case, interp, kv_scale=None)


# -- GPU: the compiled kernel ---------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_long_context_stays_accurate(d: int) -> None:
    """16k tokens of random v: the output is a small average of large values (V centred per
    element before the products, as int4's; tests/.../test_triton_decode_int4.py says why)."""
    from torch_kvq.attention.triton import decode_tma

    case = _case((16384, 16384), 32 if d == 128 else 16, 8, d, device="cuda", seed=8)
    for kw in ({}, dict(programs_per_sm=16 if d == 128 else 8, **decode_config.tuned(d, "k8v4"))):
        out = run_tma(case, decode_tma, **kw)
        err = rel_err(out, case.ref())
        assert err < 5e-3, f"{kw or 'split grid'}: rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qh,kh,d", [(32, 8, 128), (16, 8, 256), (8, 8, 64), (64, 8, 128)])
@pytest.mark.parametrize("num_splits", [1, None])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (64, 5.0)], ids=["global", "swa_cap"])
@pytest.mark.parametrize("ppi", [1, 2])
def test_gpu_split_grid_matches_reference(qh, kh, d, num_splits, window, soft_cap, ppi):
    from torch_kvq.attention.triton import decode_tma

    case = _case((*LENS, 4097), qh, kh, d, device="cuda", seed=ppi)
    kw = dict(window=window, soft_cap=soft_cap, num_splits=num_splits, pages_per_iter=ppi)
    out = run_tma(case, decode_tma, **kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-3, f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("page", [32, 64])
@pytest.mark.parametrize("num_splits", [2, None])
def test_gpu_larger_pages(d: int, page: int, num_splits: int | None) -> None:
    from torch_kvq.attention.triton import decode_tma

    case = _case((*LENS, 4097), 16, 8, d, page=page, device="cuda", seed=page)
    out = run_tma(case, decode_tma, num_splits=num_splits)
    assert torch.isfinite(out).all()
    err = rel_err(out, case.ref())
    assert err < 5e-3, f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qh,kh,d,per_sm", [(32, 8, 128, 16), (16, 8, 256, 8)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (64, 5.0)], ids=["global", "swa_cap"])
def test_gpu_balanced_matches_reference(qh, kh, d, per_sm, window, soft_cap):
    from torch_kvq.attention.triton import decode_tma

    case = _case((*LENS, 4097), qh, kh, d, device="cuda", seed=3)
    kw = dict(window=window, soft_cap=soft_cap, programs_per_sm=per_sm)
    out = run_tma(case, decode_tma, **kw, **decode_config.tuned(d, "k8v4"))
    assert torch.isfinite(out).all()
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-3, f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("math", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("gain", [1e-3, 1.0, 250.0])
def test_gpu_magnitudes_stay_accurate(math, d, gain) -> None:
    """Small and large K and V heads at the defaults (lazy at head 128, eager at 256), fp16 and
    bf16 products."""
    from torch_kvq.attention.triton import decode_tma

    case = _case((*LENS, 4097), 32 if d == 128 else 16, 8, d, device="cuda", seed=5,
                 v_gain=gain, k_gain=min(gain, 3.0))  # fmt: skip
    out = run_tma(case, decode_tma, dot_dtype=math)
    assert torch.isfinite(out).all()
    err = rel_err(out, case.ref())
    assert err < (5e-3 if math == torch.float16 else 1e-2), f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("schedule", ["split", "balanced"])
def test_gpu_cuda_graph_replay_follows_new_lengths(schedule: str) -> None:
    """Captured once; replays read seq_lens, the table and the scales from the device."""
    from torch_kvq.attention.triton import decode_balanced, decode_tma

    case = _case((1000, 1000, 1000), 32, 8, 128, device="cuda", seed=6)
    out, table = torch.empty_like(case.q), dense_table(case)
    kw: dict = dict(out=out, **decode_config.tuned(128, "k8v4"))
    if schedule == "split":
        kw.update(num_splits=4, workspace=tuple(
            torch.empty(s, device="cuda") for s in ((3, 32, 4, 128), (3, 32, 4))))  # fmt: skip
    else:
        n = decode_balanced.balanced_programs(case.q, 8, 1000, 16, 16)
        kw.update(programs_per_sm=16, workspace=tuple(
            torch.empty(s, device="cuda") for s in ((n, 2, 4, 128), (n, 2, 4))))  # fmt: skip
    run = lambda: run_tma(case, decode_tma, table, **kw)  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in ((1, 500, 999), (1, 1, 2)):
        case.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        case.lens = lens
        # new scales, same buffer: times 2 keeps each v zero point (the exponent moves)
        case.kv_scale.mul_(2.0)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, case.ref()) < 5e-3, lens
