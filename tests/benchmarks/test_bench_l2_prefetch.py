"""bench_l2_prefetch: its prefetch kernel compiles for sm90 with Triton's ptxas (no GPU needed),
and a bad mode is refused before any launch. Needs Triton (CI's CPU venv has none); run in
subprocesses without TRITON_INTERPRET, which other CPU tests set for this process (and importing
Triton here first would turn their interpreter off)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs Triton (its ptxas)", allow_module_level=True)
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV,
                          cwd=BENCH, timeout=300)  # fmt: skip


def test_prefetch_kernel_compiles_for_sm90() -> None:
    got = run("bench_l2_prefetch.py", "--ptx")
    assert got.returncode == 0, got.stderr[-2000:]
    assert "normal: cubin" in got.stdout and "evict_last: cubin" in got.stdout


def test_bad_mode_is_refused() -> None:
    code = ("import torch, bench_l2_prefetch as b\n"
            "b.prefetch(torch.empty(4, 8, dtype=torch.bfloat16), 'diag', 1 << 20)")  # fmt: skip
    got = run("-c", code)
    assert got.returncode != 0
    assert "prefetch mode 'diag': expected 'rows', 'cols' or 'all'" in got.stderr
