"""Per-layer sensitivity on a trained model (a tiny slice), and the suggestion it derives."""

from __future__ import annotations

import json
import math

import pytest

from torch_kvq import cli
from torch_kvq.evaluation.sensitivity import LayerSensitivity, SensitivityReport


def test_sensitivity_on_a_tiny_slice(tmp_path, capsys):
    out = tmp_path / "s.json"
    argv = ["--model", "smollm2-135m", "--window", "24", "--windows", "1", "--json", str(out)]
    assert cli.main(["accuracy", *argv, "--threshold-pct", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "suggestion:" in text and "fp8 on every layer at once" in text
    doc = json.loads(out.read_text())
    layers = doc["layers"]
    assert [la["index"] for la in layers] == list(range(30))
    assert all(la["mode"] == "fp8" and la["attention_type"] == "global" for la in layers)
    # each layer alone quantized: its own attention output moves, by an FP8-sized error
    assert all(0 < la["attn_rel_err"] < 0.2 for la in layers)
    assert all(math.isfinite(la["delta_pct"]) for la in layers)
    assert math.isfinite(doc["all_layers_delta_pct"][0]) and doc["reference_ppl"] > 1
    over = [la["index"] for la in layers if la["delta_pct"] > 0.5]
    kept = [int(i) for i, m in doc["choice"].items() if m == "auto"]
    assert kept == over


def _report(deltas, types, modes=("fp8",), threshold=0.1):
    layers = [
        LayerSensitivity(i, f"l{i}", t, m, 10.0, d, 0.01)
        for m, ds in zip(modes, deltas)
        for i, (d, t) in enumerate(zip(ds, types))
    ]
    return SensitivityReport(
        "m", 100, 10.0, threshold, tuple(modes), tuple(layers), (0.5,) * len(modes)
    )


def test_suggestion_keeps_layers_over_the_threshold():
    rep = _report([[0.01, 0.3, 0.02, 0.5]], ["global"] * 4)
    assert rep.choice() == {0: "fp8", 1: "auto", 2: "fp8", 3: "auto"}
    assert "layers 1,3 cost more than 0.1%" in rep.suggestion()
    assert "--kv fp8:skip=1,3" in rep.suggestion() and "skip_layers=(1, 3,)" in rep.suggestion()


def test_suggestion_names_the_sliding_rule_when_it_fits():
    rep = _report([[0.3, 0.2, 0.01]], ["sliding", "sliding", "global"])
    assert "--kv fp8:skip=sliding_window" in rep.suggestion()
    assert "skip_layers=('sliding_window',)" in rep.suggestion()
    assert "quantize all" in _report([[0.01, 0.0]], ["global"] * 2).suggestion()


def test_suggestion_with_several_modes_takes_the_first_within():
    rep = _report([[0.5, 0.05, 0.5], [0.05, 0.5, 0.5]], ["global"] * 3, modes=("int4", "fp8"))
    assert rep.choice() == {0: "fp8", 1: "int4", 2: "auto"}
    assert rep.suggestion().endswith("(auto: none is): 0:fp8,1:int4,2:auto")


def test_bad_mode_is_refused(capsys):
    assert cli.main(["accuracy", "--model", "smollm2-135m", "--mode", "auto", "--window", "8"]) == 2
    assert "mode 'auto' is not a quantized kv_cache_dtype" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_threshold_must_be_finite(bad):
    from torch_kvq.evaluation.sensitivity import layer_sensitivity

    with pytest.raises(ValueError, match="threshold_pct must be a finite number"):
        layer_sensitivity(None, [], threshold_pct=float(bad))
