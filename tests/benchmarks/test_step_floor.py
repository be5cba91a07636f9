"""step_floor on the committed H200 runs 61-63 of 2026-12-01: the floor is the sum of its parts,
and a row it cannot price is named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_skinny_gemm import BLAS  # noqa: E402
from step_floor import best_gemms, floor  # noqa: E402

SKINNY = RESULTS / "h200_2026-12-01_run61_bench_skinny_gemm_blas.json"
GEMMA = RESULTS / "h200_2026-12-01_run62_decode_at_scale_gemma_fp8_kn.json"
LLAMA_BF16 = RESULTS / "h200_2026-12-01_run63_decode_at_scale_llama_bf16_kn_cublaslt.json"


def rows(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def test_gemma_floor_adds_attention_best_gemms_and_lm_head() -> None:
    row, skinny = rows(GEMMA)[0], rows(SKINNY)
    got = floor(row, skinny)
    best = {p: min(r["ms"] for r in skinny if (r["model"], r["proj"], r["m"]) == (
        "gemma-3-12b", p, 32) and r["path"] in BLAS)
        for p in ("qkv", "o", "gate_up", "down")}  # fmt: skip
    assert {p: ms for p, (_, ms) in got["gemms"].items()} == best
    once = [k for k in row["kernels_per_step"] if k[3] == "gemm" and k[2] == 1]
    assert len(once) == 1 and got["lm_head_ms"] == once[0][1]  # the output projection's kernel
    by_kind = row["gpu_ms_by_kind"]
    want = by_kind["attention_fp8_kv"] + by_kind["attention_bf16_kv"] + 48 * sum(best.values())
    assert got["library_ms"] == pytest.approx(want + once[0][1])
    assert got["bound_ms"] == pytest.approx(32e3 / row["bound_tokens_per_s"])
    # run 62: the library kernels alone sit at the 90% line; the model's small kernels do not fit
    assert 0 < got["left_at_90pct_ms"] < got["small_kernels_ms"]


def test_a_batch_without_isolated_gemms_is_named() -> None:
    with pytest.raises(ValueError, match=r"llama-3.1-8b at M=58 .*--ms 58"):
        best_gemms(rows(SKINNY), "llama-3.1-8b", 58)
    with pytest.raises(ValueError, match="expected a profiled row"):
        floor({**rows(GEMMA)[0], "kernels_per_step": None}, rows(SKINNY))


def test_cli_prices_what_it_can_and_skips_the_rest() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_floor.py"), str(LLAMA_BF16), str(SKINNY)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "llama-3.1-8b bf16/bf16 32 x 16384: step 20.760 ms" in out.stdout
    assert "llama-3.1-8b bf16 batch 58: skipped: no isolated library GEMM" in out.stdout
