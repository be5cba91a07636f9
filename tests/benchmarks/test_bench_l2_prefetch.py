"""bench_l2_prefetch: its prefetch kernel compiles for sm90 with Triton's ptxas (no GPU needed;
skipped where Triton is not installed, as in CI), and a bad mode is refused before any launch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_l2_prefetch  # noqa: E402


def test_prefetch_kernel_compiles_for_sm90(capsys) -> None:
    bench_l2_prefetch.ptx_check()
    out = capsys.readouterr().out
    assert "normal: cubin" in out and "evict_last: cubin" in out


def test_bad_mode_is_refused() -> None:
    import torch

    with pytest.raises(ValueError, match="prefetch mode 'diag'"):
        bench_l2_prefetch.prefetch(torch.empty(4, 8, dtype=torch.bfloat16), "diag", 1 << 20)
