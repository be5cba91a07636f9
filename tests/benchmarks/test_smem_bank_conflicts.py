"""scripts/smem_bank_conflicts.py: shared-memory wavefronts counted offline from the PTX. The
bank model runs anywhere; the kernel's counts need Triton (CI's CPU venv has none) and run in a
subprocess without TRITON_INTERPRET, as tests/benchmarks/test_tma_kernel_sass.py does."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from smem_bank_conflicts import LANES, analyse, lane_groups, lop3, wavefronts  # noqa: E402


def test_bank_model() -> None:
    # 32 lanes x 4 bytes, consecutive: one wavefront; a stride of 128 bytes: all in bank 0
    assert wavefronts(LANES * 4, 4, lane_groups(4, 0)) == 1
    assert wavefronts(LANES * 128, 4, lane_groups(4, 0)) == 32
    assert wavefronts(np.zeros(32, np.uint64), 4, lane_groups(4, 0)) == 1  # a broadcast
    # 16 bytes a lane: four groups of 8 lanes, each 128 contiguous bytes
    assert wavefronts(LANES * 16, 16, lane_groups(16, 0)) == 4
    # rows 512 bytes apart (64-byte rows 8 apart) in one group of 16 lanes at 8 bytes: 2-way
    addr = np.array([(i % 2) * 512 + (i // 2) * 8 for i in range(32)], np.uint64)
    assert wavefronts(addr, 8, lane_groups(8, 0)) == 4  # two groups, each 2-way
    # ldmatrix .x4: one group per 8 x 8 matrix (lanes 8i..8i+7 give its rows)
    assert len(lane_groups(16, 4)) == 4 and wavefronts(LANES * 16, 16, lane_groups(16, 4)) == 4


def test_lop3_and_ptx_evaluation() -> None:
    a, b, c = (np.array([x], np.uint64) for x in (0xF0F0, 0xFF00, 0x0FF0))
    assert int(lop3(a, b, c, 0xE8)[0]) == (0xF0F0 & 0xFF00) | (0xF0F0 & 0x0FF0) | (0xFF00 & 0x0FF0)
    assert int(lop3(a, b, c, 0x96)[0]) == 0xF0F0 ^ 0xFF00 ^ 0x0FF0
    ptx = """
        mov.u32 %r1, %tid.x;
        shl.b32 %r2, %r1, 7;
        mov.b32 %r3, global_smem;
        add.s32 %r4, %r3, %r2;
        ld.shared.b32 %r5, [%r4+4];
        xor.b32 %r6, %r2, %r1;
        shl.b32 %r7, %r6, 2;
        ld.shared.b32 %r8, [%r7];
    """
    first, second = analyse(ptx)
    assert (first["wavefronts"], first["ideal"]) == (32, 1)  # a 128-byte stride: one bank
    # lane ^ (lane << 7) as words: no two lanes in one bank
    assert (second["wavefronts"], second["ideal"]) == (1, 1)
    assert not first["assumed"] and not second["in_loop"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (ptxas)")
def test_int4_decode_reports_the_conflicts_nsight_measured() -> None:
    """Nsight Compute measured 18 excessive shared wavefronts per page of the two-heads loop
    before V's codes had their layout (2,359,296 over 131,072 pair-pages, fd40bea:
    docs/design/int4-branch.md), 16 of them V's; with ``v_layout``'s positions 2 are left (the
    weights' ``ldmatrix``): V's 16-byte loads and K's ``ldmatrix`` are free of them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(ROOT / "scripts" / "smem_bank_conflicts.py"), "--kv-heads", "2"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True)
    lines = out.stdout.splitlines()
    k_rows = [t for t in lines if "ldmatrix.sync.aligned.m8n8.x4.shared" in t]
    assert k_rows and all("conflicts" not in t for t in k_rows)
    assert "2 excessive" in lines[-1], lines[-1]
    v_loads = [t for t in lines if t.startswith("int4.py") and "ld.shared.v4" in t]
    assert v_loads and all("conflicts" not in t for t in v_loads)
