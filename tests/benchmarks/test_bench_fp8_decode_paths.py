"""bench_fp8_decode_paths on the CPU: its command line, the paths it times (the package's), the
per-call mode split and the markdown table it writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_fp8_decode_paths.py"
import bench_fp8_decode_paths as paths  # noqa: E402


def test_help_runs_without_a_gpu() -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                         check=True, timeout=120).stdout  # fmt: skip
    assert "--quick" in out and "--rounds" in out and "--calls" in out and "--paths" in out


def test_unknown_path_is_refused_by_name() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--paths", "triton_tma,nope"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode != 0 and "unknown paths ['nope']" in run.stderr


def test_times_the_package_paths_at_both_models_shapes() -> None:
    assert list(paths.PATHS) == [
        "fi_tc_bf16", "fi_tc_fp8", "fi_tc_fp8[bf16 math]", "xqa_fp8", "triton_tma",
        "triton_int8_per_token_head", "triton_fp8_per_token_head", "triton_int4_per_token_head",
        "triton_k8v4_per_token_head",
    ]  # fmt: skip
    assert {name for name, _ in paths.CASES} == set(paths.SHAPES)
    assert {batch for _, batch in paths.CASES} == {32, 110, 131}


def test_modes_splits_two_clusters_and_not_one() -> None:
    two = paths.modes([1.0] * 30 + [1.3] * 70)
    assert two["bimodal"] and two["low_frac"] == 0.3
    assert two["low_ms"] == 1.0 and two["high_ms"] == 1.3
    one = paths.modes([1.0 + i * 1e-3 for i in range(100)])
    assert not one["bimodal"] and one["p50"] == 1.05


def test_markdown_has_a_row_per_result_and_says_why_a_path_failed() -> None:
    env, copy = {"gpu": "test"}, {"GBps": 4000.0}
    ok = {"shape": "llama", "batch": 32, "ctx": 16384, "path": "triton_tma", "ms": 0.27,
          "ms_min": 0.26, "ms_max": 0.28, "pct_copy": 94.0, "bound_ms": 0.25, "rel_err": 1.7e-3,
          "per_call": paths.modes([0.27] * 20)}  # fmt: skip
    bad = {"shape": "llama", "batch": 32, "ctx": 16384, "path": "xqa_fp8", "error": "no module"}
    md = paths.markdown(env, copy, [ok, bad])
    assert "copy bandwidth (read+write): 4000 GB/s" in md
    assert "| llama | 32 x 16384 | triton_tma | 0.2700 (0.2600..0.2800) | 94.0 |" in md
    assert "| llama | 32 x 16384 | xqa_fp8 | error: no module |" in md
