"""benchmarks/merge_scale_rows.py: rows replace their key's, the event mean, kinds by today's
names, rows read back from a run's log."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import merge_scale_rows as msr  # noqa: E402
import pytest

BASE = dict(model="llama-3.1-8b", kv_config="fp8", kernel="triton", batch=110, ctx=16384,
            sweep="capacity", fused_projections=True, bound_tokens_per_s=3300.0)  # fmt: skip


def test_merge_replaces_by_key_and_appends_new_keys() -> None:
    old = [{**BASE, "tokens_per_s": 1.0}, {**BASE, "batch": 32, "tokens_per_s": 2.0}]
    new = [{**BASE, "tokens_per_s": 3.0}, {**BASE, "fused_projections": None, "tokens_per_s": 4.0}]
    rows = msr.merge(old, new)
    assert [r["tokens_per_s"] for r in rows] == [3.0, 2.0, 4.0]


def test_event_mean_from_step_times_keeps_the_wall_clock() -> None:
    row = {**BASE, "step_ms": 38.28, "step_times_ms": [36.0, 37.0, 38.0], "tokens_per_s": 2873.0}
    out = msr.event_mean(row)
    assert out["step_ms"] == pytest.approx(37.0) and out["wall_step_ms"] == 38.28
    assert out["tokens_per_s"] == pytest.approx(110e3 / 37.0)
    assert out["pct_of_bound"] == pytest.approx(100 * 110e3 / 37.0 / 3300.0)
    assert msr.event_mean(out) is out  # already an event mean: unchanged
    assert msr.event_mean({**BASE, "step_ms": 5.0}) == {**BASE, "step_ms": 5.0}  # no times


def test_reclassify_moves_a_kernel_to_its_kind() -> None:
    row = {**BASE, "gpu_ms_by_kind": {"other": 27.29, "attention_fp8_kv": 0.17},
           "kernels_per_step": [["_decode_balanced", 26.56, 30.0, "other"],
                                ["_combine_balanced", 0.17, 30.0, "attention_fp8_kv"]]}  # fmt: skip
    out = msr.reclassify(row)
    assert out["gpu_ms_by_kind"] == {"other": pytest.approx(0.73), "attention_fp8_kv": 26.73}
    assert out["kernels_per_step"][0][3] == "attention_fp8_kv"


def test_cli_reads_json_and_log_rows(tmp_path: Path) -> None:
    into = tmp_path / "rows.json"
    into.write_text(json.dumps([{**BASE, "tokens_per_s": 1.0}]))
    raw = tmp_path / "run.json"
    raw.write_text(json.dumps({"rows": [{**BASE, "batch": 80, "tokens_per_s": 2.0}]}))
    log = tmp_path / "log.txt"
    log.write_text(
        "=== scale\n"
        + repr({**BASE, "tokens_per_s": 3.0, "clocks": {"n": 2, "samples": [[0, 1]]}})
        + "\n"
    )
    argv = sys.argv
    try:
        sys.argv = ["merge", str(raw), "--log", str(log), "--into", str(into)]
        msr.main()
    finally:
        sys.argv = argv
    rows = json.loads(into.read_text())
    assert [(r["batch"], r["tokens_per_s"]) for r in rows] == [(110, 3.0), (80, 2.0)]
    assert rows[0]["clocks"] == {"n": 2}  # samples stay in the run's own JSON
