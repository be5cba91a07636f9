"""benchmarks/bench_tp_decode.py in its CPU smoke mode (2 gloo ranks, tiny shapes), so the GPU
script cannot break silently: both parts run and write their JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.launch import ROOT, torchrun


@pytest.mark.distributed
def test_bench_tp_decode_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    script = ROOT / "benchmarks" / "bench_tp_decode.py"
    out = torchrun(script, "--smoke", "--device", "cpu", "--part", "all", timeout=240)
    assert out.returncode == 0, out.stdout[-4000:]
    scaling = json.loads((tmp_path / "bench_tp_decode_scaling_smoke.json").read_text())["rows"]
    assert [(r["tp"], r["kv"]) for r in scaling] == [(1, "fp8"), (2, "fp8")]
    assert all(r["tokens_per_s"] > 0 and r["batch"] == 4 for r in scaling)
    assert "scaling_efficiency" in scaling[1] and len(scaling[1]["step_ms_all_ranks"]) == 2
    fit = {
        r["kv"]: r
        for r in json.loads(Path(tmp_path / "bench_tp_decode_fit_smoke.json").read_text())["rows"]
    }
    # the same KV budget holds more FP8 pages than bf16 ones (layers 0 and -1 stay bf16)
    assert fit["fp8"]["pages"] > fit["bf16"]["pages"] > 0
    assert fit["fp8"]["page_bytes_per_rank"] < fit["bf16"]["page_bytes_per_rank"]
    assert "Tensor-parallel decode (fit)" in out.stdout
