"""bench_kv_write on the CPU: its command line, the smoke run (every mode's aten write) and the
bytes each mode is charged (codes and scales), and the markdown table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from torch_kvq.attention import v_layout

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_kv_write.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_kv_write as bench  # noqa: E402


def test_smoke_runs_every_mode_on_the_cpu() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True,
                         check=True, timeout=300).stdout  # fmt: skip
    assert (
        "smoke ok: bf16, fp8_per_tensor, int8_per_token_head, fp8_per_token_head, "
        "int4_per_token_head, k8v4_per_token_head" in out
    )


def test_bytes_count_reads_codes_and_scales() -> None:
    t, kh, d = 40, 2, 64
    got = {m: bench.make_write(m, kh, d, t, "cpu").nbytes for m in bench.MODES}
    kv_in, slots = 2 * t * kh * d * 2, t * 8
    assert got["bf16"] == kv_in + 2 * t * kh * d * 2 + slots
    assert got["fp8_per_tensor"] == kv_in + 2 * t * kh * d + slots
    scales = 2 * t * kh * 4
    assert got["int8_per_token_head"] == got["fp8_per_token_head"] == got["fp8_per_tensor"] + scales
    assert got["int4_per_token_head"] == kv_in + 2 * t * kh * (d // 2) + scales + slots
    assert got["k8v4_per_token_head"] == kv_in + t * kh * (d + d // 2) + scales + slots


def test_int4_write_lands_packed() -> None:
    w = bench.make_write("int4_per_token_head", 2, 64, 40, "cpu")
    assert w.cache.dtype == torch.uint8 and w.cache.shape[-1] == 32
    w.call()
    assert int(w.kv_scale.gt(0).sum()) == 2 * 40 * 2
    rows = torch.stack((w.cache[:, 0], v_layout.v_from_cache(w.cache[:, 1])), 1)  # a token a row
    assert int(rows.ne(0).any(-1).sum()) == 2 * 40 * 2  # every (token, head) row written


def test_k8v4_write_lands_in_three_slots() -> None:
    w = bench.make_write("k8v4_per_token_head", 2, 64, 40, "cpu")
    assert w.cache.dtype == torch.uint8 and w.cache.shape[1:] == (3, 16, 2, 32)
    w.call()
    assert int(w.kv_scale.gt(0).sum()) == 2 * 40 * 2
    rows = torch.cat((w.cache[:, :2], v_layout.v_from_cache(w.cache[:, 2:])), 1)  # a token a row
    assert int(rows.ne(0).any(-1).sum()) == 3 * 40 * 2  # k's two halves and v, every row


def test_the_write_lands_in_the_cache() -> None:
    w = bench.make_write("int8_per_token_head", 2, 64, 40, "cpu")
    assert w.cache.dtype == torch.int8 and not w.cache.any()
    w.call()
    assert int(w.kv_scale.gt(0).sum()) == 2 * 40 * 2  # k and v, 40 tokens, 2 heads
    assert int(w.cache.abs().amax(-1).eq(127).sum()) == 2 * 40 * 2  # each head reaches QMAX


def test_page_slots_fill_whole_pages_in_order() -> None:
    """``slots="pages"``: 40 tokens fill two whole pages and half a third, each page's tokens at
    its consecutive offsets; ``"tokens"`` scatters them over more pages."""
    w = bench.make_write("bf16", 2, 64, 40, "cpu", "pages")
    w.call()
    used = w.cache.abs().amax(dim=(3, 4))[:, 0].gt(0)  # [pages, page]: k written
    full = used.all(-1)
    assert int(full.sum()) == 2 and int(used.any(-1).sum()) == 3
    part = used[used.any(-1) & ~full][0]
    assert part.tolist() == [True] * 8 + [False] * 8  # the first 8 offsets of the third page
    scattered = bench.make_write("bf16", 2, 64, 40, "cpu", "tokens")
    scattered.call()
    assert int(scattered.cache.abs().amax(dim=(3, 4))[:, 0].gt(0).any(-1).sum()) > 3


def test_markdown_rows_and_errors() -> None:
    env, copy = {"gpu": "test"}, {"GBps": 4000.0}
    ok = {"shape": "llama", "tokens": 32, "slots": "pages", "mode": "bf16", "ms": 0.01,
          "ms_min": 0.009, "ms_max": 0.011, "GBps": 100.0, "pct_copy": 2.5}  # fmt: skip
    bad = {"shape": "llama", "tokens": 32, "mode": "int8_per_token_head", "error": "boom"}
    md = bench.markdown(env, copy, [ok, bad])
    assert "| llama | 32 | pages | bf16 | 0.0100 (0.0090..0.0110) | 100 | 2.5 |" in md
    assert "| llama | 32 | tokens | int8_per_token_head | error: boom |" in md
