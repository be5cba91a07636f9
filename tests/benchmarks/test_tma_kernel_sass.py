"""scripts/tma_kernel_sass.py: the TMA decode kernel compiled for sm90 without a GPU (needs
Triton, which ships the ptxas / cuobjdump it uses; CI's CPU venv has no Triton)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import tma_kernel_sass as sass  # noqa: E402


@pytest.mark.parametrize("ppi", [1, 2])
def test_loop_holds_one_tma_copy_per_page_and_its_mma(ppi: int) -> None:
    stats, body, text = sass.sass_stats(sass.compile_kernel(128, 4, ppi, 6, 1, lazy=True))
    # per page: a K box and a V box, and 16 + 16 m16n8k16 mma for q.k^T and p.v
    assert stats["UTMALDG.2D"] == 2 * ppi
    assert stats["HMMA.16816.F32"] == 32 * ppi
    assert stats["F2FP.F16.E4M3.UNPACK_B"] == 64 * ppi  # e4m3 -> fp16, two values per op
    assert 0 < stats["registers"] <= 255 and stats["shared_bytes"] > 0
    assert len(body) == stats["loop_instructions"] and "EXIT" in text
