"""bench_fp8_decode_paths and its studies (fp8_decode_studies) on the CPU: the command line offers
every study, refuses two at once before touching a GPU, and each study takes the same arguments."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_fp8_decode_paths.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
from fp8_decode_studies import STUDIES  # noqa: E402


def test_every_study_is_offered_and_takes_the_same_arguments() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                         check=True, timeout=120).stdout  # fmt: skip
    assert {"fp16", "tma", "batch", "vperm", "sliding", "balanced"} <= set(STUDIES)
    for name, (study, what) in STUDIES.items():
        assert f"--{name}-study" in out
        assert list(inspect.signature(study).parameters) == ["gbps", "rounds", "calls", "save"]
        assert what


def test_two_studies_at_once_are_refused() -> None:
    got = subprocess.run([sys.executable, str(SCRIPT), "--tma-study", "--sliding-study"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert got.returncode == 2 and "one --<name>-study at a time" in got.stderr
