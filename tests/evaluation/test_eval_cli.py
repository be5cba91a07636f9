"""``kvq eval`` end to end on short windows, and the ``--kv`` syntax."""

from __future__ import annotations

import json
import math

import pytest

from torch_kvq import cli
from torch_kvq.evaluation.kv_arg import parse_kv

SHORT = ["--window", "48", "--windows", "2", "--decode-tokens", "6", "--prompts", "2"]
SHORT += ["--prompt-tokens", "8", "--new-tokens", "4"]


def test_eval_end_to_end(tmp_path, capsys):
    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    argv = ["--model", "smollm2-135m", "--kv", "fp8", "--kv", "first2=fp8:skip=0,1", *SHORT]
    assert cli.main(["eval", *argv, "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "KV config" in text and "first2" in text
    doc = json.loads(out.read_text())
    assert doc["settings"]["window"] == 48
    assert doc["corpus"]["smollm2-135m"] == {
        "windows": ["ca01", "cb01"],
        "prompts": ["ca01", "cb01"],
    }
    auto, fp8, first2 = doc["rows"]
    assert (auto["kv"], fp8["kv"], first2["kv"]) == ("auto", "fp8", "first2")
    assert auto["ppl_delta_pct"] == 0 and auto["agreement"] == 1 and auto["common_prefix"] == [4, 4]
    assert (auto["quantized_layers"], fp8["quantized_layers"], first2["quantized_layers"]) == (
        0,
        30,
        28,
    )
    for row in (fp8, first2):
        assert math.isfinite(row["ppl"]) and row["ppl"] != auto["ppl"]
        assert math.isfinite(row["decode_ppl"]) and abs(row["ppl_delta_pct"]) < 10
        assert 0 <= row["agreement"] <= 1 and len(row["common_prefix"]) == 2
        assert (
            row["kernel"] == "reference" and row["compile"] == "off" and row["dtype"] == "float32"
        )
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_kv_is_refused(capsys):
    assert cli.main(["eval", "--model", "smollm2-135m", "--kv", "fp9"]) == 2
    assert "kvq eval: error: --kv 'fp9': unknown kv_cache_dtype 'fp9'" in capsys.readouterr().err


def test_a_bad_config_stops_the_run_before_any_runs(monkeypatch, capsys):
    """A skip rule the model cannot have (layer 99 of 30), given last: refused before the first
    run (the rows before it would otherwise be computed, then lost)."""
    from torch_kvq.evaluation import eval as ev

    def no_run(*a, **kw):
        raise AssertionError("a run started before every config was checked")

    monkeypatch.setattr(ev, "evaluate", no_run)
    argv = ["--model", "smollm2-135m", "--kv", "fp8", "--kv", "late=fp8:skip=99"]
    assert cli.main(["eval", *argv, *SHORT]) == 2
    err = capsys.readouterr().err
    assert "kvq eval: error: --kv 'fp8:skip=99' on smollm2-135m: skip_layers index 99" in err, err


@pytest.mark.parametrize(
    "text, name, dtype, skip, k, v",
    [
        ("fp8", "fp8", "fp8", (), 1.0, 1.0),
        ("x=fp8:skip=sliding_window,-1", "x", "fp8", ("sliding_window", -1), 1.0, 1.0),
        ("fp8:scale=2", "fp8:scale=2", "fp8", (), 2.0, 2.0),
        ("a=fp8:k_scale=0.5:v_scale=4", "a", "fp8", (), 0.5, 4.0),
        ("auto", "auto", "auto", (), 1.0, 1.0),
    ],
)
def test_parse_kv(text, name, dtype, skip, k, v):
    kv = parse_kv(text)
    assert (kv.name, kv.kv_cache_dtype, kv.skip_layers) == (name, dtype, skip)
    cfg = kv.config(16)
    assert (cfg.default_k_scale, cfg.default_v_scale, cfg.skip_layers) == (k, v, skip)


@pytest.mark.parametrize(
    "text, match",
    [
        ("fp9", "unknown kv_cache_dtype 'fp9'"),
        ("fp8:skipp=0", "option 'skipp=0' unknown"),
        ("fp8:scale=-1", "must be a positive finite number"),
        ("fp8:scale=2:k_scale=3", "k_scale given twice"),
        ("fp8:scales=/no/such.safetensors", "does not exist"),
        ("name=", "expected \\[NAME=\\]DTYPE"),
    ],
)
def test_parse_kv_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_kv(text)


def test_parse_kv_map_takes_the_rest_of_the_spec():
    kv = parse_kv("mixed=auto:skip=1:map=0:fp8,full_attention:int8_per_token_head,3-4:fp8")
    assert (kv.name, kv.kv_cache_dtype, kv.skip_layers) == ("mixed", "auto", (1,))
    assert kv.layer_modes == (
        (0, "fp8"), ("full_attention", "int8_per_token_head"), (3, "fp8"), (4, "fp8")
    )  # fmt: skip
    cfg = kv.config(page_size=16)
    assert cfg.layer_modes == kv.layer_modes and cfg.skip_layers == (1,)
    with pytest.raises(ValueError, match=r"--kv 'auto:map=0': map entry '0' is not RULE:MODE"):
        parse_kv("auto:map=0")


def test_parse_kv_channels():
    kv = parse_kv("s=int4_per_token_head:channels=calibrate:skip=0")
    assert (kv.name, kv.channels, kv.skip_layers) == ("s", "calibrate", (0,))
    kv = parse_kv("int4-recommended:channels=calibrate")
    assert (kv.preset, kv.channels) == ("int4-recommended", "calibrate")
    with pytest.raises(
        ValueError, match="takes no option but one channels= \\(got 'channels=calibrate:skip=0'\\)"
    ):
        parse_kv("int4-recommended:channels=calibrate:skip=0")


def test_eval_with_calibrated_k_channels(tmp_path, capsys):
    """channels=calibrate: K channel scales calibrated on the calibration split, on the int4
    layers of the config (a preset's too); the rows differ from plain int4's."""
    out = tmp_path / "eval.json"
    kvs = ["--kv", "int4_per_token_head", "--kv", "s=int4_per_token_head:channels=calibrate"]
    kvs += ["--kv", "rs=int4-recommended:channels=calibrate"]
    argv = ["--model", "smollm2-135m", *kvs, *SHORT, "--json", str(out)]
    assert cli.main(["eval", *argv]) == 0
    rows = {r["kv"]: r for r in json.loads(out.read_text())["rows"]}
    plain, scaled, rec = rows["int4_per_token_head"], rows["s"], rows["rs"]
    assert scaled["quantized_layers"] == plain["quantized_layers"] == 30
    assert math.isfinite(scaled["ppl"]) and scaled["ppl"] != plain["ppl"]
    assert rec["quantized_layers"] == 30 and math.isfinite(rec["ppl"])


def test_eval_with_calibrated_k_bases(tmp_path, capsys):
    """basis=calibrate: K bases calibrated once on the calibration split, for the tc4 layers of
    the config, a map's and the tc4-recommended preset's too (every SmolLM2 layer is full
    attention: the same row); basis= files are test_calibrate_text.py's."""
    out = tmp_path / "eval.json"
    kvs = ["--kv", "tc=tc4_per_token_head:basis=calibrate"]
    kvs += ["--kv", "map=auto:basis=calibrate:map=full_attention:tc4_per_token_head"]
    kvs += ["--kv", "rec=tc4-recommended:basis=calibrate"]
    argv = ["--model", "smollm2-135m", *kvs, *SHORT, "--json", str(out)]
    assert cli.main(["eval", *argv]) == 0
    rows = {r["kv"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["tc"]["quantized_layers"] == rows["map"]["quantized_layers"] == 30
    assert rows["rec"]["quantized_layers"] == 30
    assert math.isfinite(rows["tc"]["ppl"]) and rows["tc"]["ppl"] == rows["map"]["ppl"]
    assert rows["rec"]["ppl"] == rows["tc"]["ppl"]
