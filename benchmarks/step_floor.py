"""How close a decode step can come to its bandwidth bound when every op is its own kernel.

Reads a ``bench_decode_at_scale`` row that was profiled (``kernels_per_step``) and a
``bench_skinny_gemm`` run on the same GPU, and adds up what the step cannot do without: its
attention kernels as the model ran them, each projection at the best library GEMM measured in
isolation (``BLAS`` paths; each call on its own copy of the weight) times the layers, and the
output projection as the model ran it. Set against the bound (weights + KV bytes at copy bandwidth)
that sum says how much of the step is left for the small kernels (norms, RoPE, cache writes,
activations) and the gaps between kernels before a share of the bound is out of reach.

Run 62 (H200, 2026-12-01), Gemma-3-12B FP8 at 32 x 16k with run 61's GEMMs: the library kernels
alone take 13.37 ms (a step of only these would run at 90.2% of the 12.06 ms bound; 90% is 13.40
ms): 0.035 ms would be left for the 0.82 ms of small kernels and 0.38 ms of gaps that the model spends.

    python benchmarks/step_floor.py \\
        benchmarks/results/h200_2026-12-01_run62_decode_at_scale_gemma_fp8_kn.json \\
        benchmarks/results/h200_2026-12-01_run61_bench_skinny_gemm_blas.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_at_scale import MODELS  # noqa: E402
from bench_skinny_gemm import BLAS, SHAPES  # noqa: E402


def layers(model: str) -> int:
    """The model's layer count, from the config bench_decode_at_scale builds it with."""
    return MODELS[model][2]["num_hidden_layers"]


def best_gemms(skinny_rows: list[dict], model: str, m: int) -> dict[str, tuple[str, float]]:
    """Per projection of ``model`` at ``m`` rows: (fastest library path, its ms per call)."""
    best: dict[str, tuple[str, float]] = {}
    for r in skinny_rows:
        if r.get("model") == model and r.get("m") == m and r.get("path") in BLAS and "ms" in r:
            if r["proj"] not in best or r["ms"] < best[r["proj"]][1]:
                best[r["proj"]] = (r["path"], r["ms"])
    missing = set(SHAPES[model][0]) - set(best)
    if missing:
        raise ValueError(
            f"no isolated library GEMM for {model} at M={m} ({sorted(missing)}): expected a "
            f"bench_skinny_gemm run with --ms {m}"
        )
    return best


def floor(row: dict[str, Any], skinny_rows: list[dict]) -> dict[str, Any]:
    """The step's library-kernel floor (ms) beside its bound and its measured small work."""
    if not row.get("kernels_per_step") or not row.get("bound_tokens_per_s"):
        raise ValueError(
            f"row {row.get('model')} {row.get('kv_config')} batch {row.get('batch')}: expected a "
            "profiled row (kernels_per_step) with a bound (bound_tokens_per_s)"
        )
    model, batch = row["model"], row["batch"]
    by_kind = row["gpu_ms_by_kind"]
    gemms = best_gemms(skinny_rows, model, batch)
    projections = layers(model) * sum(ms for _, ms in gemms.values())
    # the output projection: the step's GEMM kernels that run once per step
    lm_head = sum(
        ms for _, ms, calls, kind in row["kernels_per_step"] if kind == "gemm" and calls == 1
    )
    attention = {k: v for k, v in by_kind.items() if k.startswith("attention")}
    library = sum(attention.values()) + projections + lm_head
    bound = batch / row["bound_tokens_per_s"] * 1e3
    return {
        "model": model, "kv_config": row["kv_config"], "kernel": row["kernel"], "batch": batch,
        "ctx": row["ctx"], "step_ms": row["step_ms"], "bound_ms": bound,
        "attention_ms": attention, "projections_ms": projections, "gemms": gemms,
        "lm_head_ms": lm_head, "library_ms": library, "library_pct_of_bound": 100 * bound / library,
        "ms_at_90pct": bound / 0.9, "left_at_90pct_ms": bound / 0.9 - library,
        "small_kernels_ms": by_kind.get("other", 0.0),
        "launch_gaps_ms": row.get("launch_gap_ms_per_step"),
    }  # fmt: skip


def report(f: dict[str, Any]) -> str:
    gemms = ", ".join(f"{p} {path} {ms * 1e3:.1f} us" for p, (path, ms) in f["gemms"].items())
    att = ", ".join(f"{k} {v:.3f}" for k, v in f["attention_ms"].items())
    return "\n".join([
        f"{f['model']} {f['kv_config']}/{f['kernel']} {f['batch']} x {f['ctx']}: step "
        f"{f['step_ms']:.3f} ms, bound {f['bound_ms']:.3f} ms, 90% of it at {f['ms_at_90pct']:.3f} ms",
        f"  attention as the model ran it: {att} ms",
        f"  projections at the best isolated GEMM x {layers(f['model'])} layers: "
        f"{f['projections_ms']:.3f} ms ({gemms})",
        f"  output projection as the model ran it: {f['lm_head_ms']:.3f} ms",
        f"  library kernels alone: {f['library_ms']:.3f} ms (a step of only these: "
        f"{f['library_pct_of_bound']:.1f}% of the bound); left before 90%: "
        f"{f['left_at_90pct_ms']:.3f} ms for the small kernels ({f['small_kernels_ms']:.3f} ms "
        f"in the model) and gaps ({f['launch_gaps_ms']} ms)",
    ])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scale", type=Path, help="bench_decode_at_scale JSON (profiled rows)")
    ap.add_argument("skinny", type=Path, help="bench_skinny_gemm JSON, same GPU")
    args = ap.parse_args()
    skinny = json.loads(args.skinny.read_text())["rows"]
    rows = [r for r in json.loads(args.scale.read_text())["rows"] if r.get("kernels_per_step")]
    if not rows:
        raise SystemExit(f"{args.scale}: no profiled row (kernels_per_step)")
    done = 0
    for r in rows:
        try:
            print(report(floor(r, skinny)))
            done += 1
        except ValueError as e:  # a row this GEMM run has no M for: said, the others still run
            print(f"{r['model']} {r['kv_config']} batch {r['batch']}: skipped: {e}")
    if not done:
        raise SystemExit("no row could be set against these GEMMs")


if __name__ == "__main__":
    main()
