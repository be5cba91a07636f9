"""Merge rows of ``bench_decode_at_scale`` runs into benchmarks/results/decode_at_scale.json.

A row replaces the one with the same (model, kv_config, kernel, batch, ctx, sweep,
fused_projections); later inputs win. Inputs are the JSON a run wrote ($OUT/decode_at_scale.json)
or, with ``--log``, a run log whose printed row dicts are read back (a run cut by its time limit
prints its rows before it writes the JSON).

Clock samples (``--sample-clocks``) stay in the run's own JSON: only their summary is merged.
Every row's profiled GPU time by kind follows today's ``bench_model_decode.KERNEL_KINDS``: a
listed kernel whose recorded kind differs moves its time (run 43 counted ``_decode_balanced``,
the balanced schedule, as "other").

``--event-mean``: for rows written before the benchmark took its mean from the in-stream step
intervals (runs 43-46 of 2026-12-01, whose wall clock started while the settle steps still
ran), recompute ``step_ms`` / ``tokens_per_s`` / ``pct_of_bound`` from the recorded
``step_times_ms`` and keep the wall clock's value as ``wall_step_ms``.

    python benchmarks/merge_scale_rows.py results/h200_..._run43_....json --event-mean
    python benchmarks/merge_scale_rows.py --log results/h200_..._run46_log.txt --event-mean
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_model_decode import kernel_kind  # noqa: E402

KEY = ("model", "kv_config", "kernel", "batch", "ctx", "sweep", "fused_projections")


def log_rows(text: str) -> list[dict]:
    """The row dicts a run printed, one per line (``{'model': ...}``)."""
    return [ast.literal_eval(line) for line in text.splitlines() if line.startswith("{'model'")]


def event_mean(row: dict) -> dict:
    """The row with its mean step from ``step_times_ms`` (unchanged without them)."""
    times = row.get("step_times_ms")
    if not times or "wall_step_ms" in row:
        return row
    mean = sum(times) / len(times)
    out = {**row, "wall_step_ms": row["step_ms"], "step_ms": mean}
    out["tokens_per_s"] = row["batch"] * 1e3 / mean
    if row.get("bound_tokens_per_s"):
        out["pct_of_bound"] = 100 * out["tokens_per_s"] / row["bound_tokens_per_s"]
    out["mean_from"] = "step_times_ms (merge_scale_rows --event-mean)"
    return out


def reclassify(row: dict) -> dict:
    """``gpu_ms_by_kind`` with each listed kernel under its kind by today's names."""
    kinds = dict(row.get("gpu_ms_by_kind") or {})
    kernels = []
    for name, ms, calls, kind in row.get("kernels_per_step") or []:
        now = kernel_kind(name)
        if now != kind:
            kinds[kind] = round(kinds.get(kind, 0.0) - ms, 4)
            kinds[now] = round(kinds.get(now, 0.0) + ms, 4)
        kernels.append([name, ms, calls, now])
    return {**row, "gpu_ms_by_kind": kinds, "kernels_per_step": kernels} if kernels else row


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with every row of ``new`` in place of its key's (appended if new)."""
    index = {tuple(r.get(k) for k in KEY): i for i, r in enumerate(old)}
    rows = list(old)
    for r in new:
        k = tuple(r.get(k) for k in KEY)
        if k in index:
            rows[index[k]] = r
        else:
            index[k] = len(rows)
            rows.append(r)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="*", type=Path, help="JSON files a run wrote")
    ap.add_argument("--log", nargs="*", type=Path, default=[], help="run logs (printed rows)")
    ap.add_argument("--event-mean", action="store_true")
    ap.add_argument("--into", type=Path, default=HERE / "results" / "decode_at_scale.json")
    args = ap.parse_args()
    new = [r for p in args.inputs for r in json.loads(p.read_text())["rows"]]
    new += [r for p in args.log for r in log_rows(p.read_text())]
    new = [reclassify(r) for r in new]
    for r in new:  # the samples stay in the run's raw JSON; the summary comes along
        if isinstance(r.get("clocks"), dict):
            r["clocks"] = {k: v for k, v in r["clocks"].items() if k != "samples"}
    if args.event_mean:
        new = [event_mean(r) for r in new]
    rows = merge(json.loads(args.into.read_text()), new)
    args.into.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{len(new)} rows merged into {args.into} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
