"""Calibration from text: statistics, scale methods, and a file ``kv_scales_from`` reads back."""

from __future__ import annotations

import json
import math

import pytest

from torch_kvq import cli
from torch_kvq.evaluation.calibrate import LayerStats, Method, scale_of, scales_from_stats
from torch_kvq.integrations.hf_scales import checkpoint_kv_scales
from torch_kvq.integrations.transformers import KVQCausalLM
from torch_kvq.spec import KVCacheConfig


def test_calibrate_writes_scales_that_kv_scales_from_reads(smollm2, tmp_path, capsys):
    hf, _ = smollm2
    out, stats = tmp_path / "kv.safetensors", tmp_path / "stats.json"
    argv = ["--model", "smollm2-135m", "--window", "32", "--windows", "2", "--out", str(out)]
    assert cli.main(["calibrate", *argv, "--stats-json", str(stats)]) == 0
    assert "cc02" not in capsys.readouterr().out  # two texts: ca02, cb02
    doc = json.loads(stats.read_text())
    assert doc["meta"]["calibration_texts"] == "ca02,cb02"
    paths = list(doc["layers"])
    assert len(paths) == 30 and paths[0] == "model.layers.0.self_attn"
    scales = checkpoint_kv_scales(out, paths)
    for path, (k, v) in scales.items():
        st = doc["layers"][path]
        for scale, amax in ((k, st["k"]["amax"]), (v, st["v"]["amax"])):
            assert math.log2(scale) == int(math.log2(scale))  # the default: a power of two
            assert scale * 224 >= amax > scale * 112  # the smallest with 2x room above amax
    lm = KVQCausalLM.from_hf(hf, KVCacheConfig("fp8"), num_pages=4, kv_scales_from=out)
    try:
        assert [(s.k_scale, s.v_scale) for s in lm.kv_specs] == [scales[p] for p in paths]
    finally:
        lm.detach()
    exact = tmp_path / "p999.safetensors"
    flags = ["--statistic", "p99.9", "--headroom", "1", "--no-pow2", "--only", "k"]
    assert cli.main(["calibrate", "--stats-from", str(stats), "--out", str(exact), *flags]) == 0
    again = checkpoint_kv_scales(exact, paths)
    first = doc["layers"][paths[0]]
    assert again[paths[0]] == pytest.approx((first["k"]["p99.9"] / 448, 1.0), rel=1e-6)


def test_default_method_has_headroom_for_unseen_text():
    """amax x 2, then a power of two up: an amax of 100 gets 0.5 (room to 224), never less than
    twice the sample's amax / 448; the CLI's default is the same method."""
    from torch_kvq.cli.calibrate import DEFAULT_HEADROOM
    from torch_kvq.evaluation.calibrate import DEFAULT_METHOD

    assert DEFAULT_METHOD == Method("amax", DEFAULT_HEADROOM, pow2=True)
    assert scale_of(100.0, DEFAULT_METHOD, "l", "k") == 0.5
    assert scale_of(112.0, DEFAULT_METHOD, "l", "k") == 0.5
    assert scale_of(112.1, DEFAULT_METHOD, "l", "k") == 1.0


def test_scale_methods():
    assert scale_of(448.0, Method(), "l", "k") == 1.0
    assert scale_of(449.0, Method(), "l", "k") == 2.0
    assert scale_of(100.0, Method(), "l", "k") == 0.25
    assert scale_of(100.0, Method(headroom=2, pow2=False), "l", "k") == pytest.approx(200 / 448)
    st = {
        "p": LayerStats(
            k={"amax": 8.0, "p99": 2.0}, v={"amax": 4.0, "p99": 1.0}, clipped_at_1=(0, 0)
        )
    }
    assert scales_from_stats(st, Method("p99", pow2=False))["p"] == (2 / 448, 1 / 448)
    with pytest.raises(ValueError, match="layer 'l': v amax is 0.0"):
        scale_of(0.0, Method(), "l", "v")
    with pytest.raises(ValueError, match="statistic 'median' unknown"):
        Method("median")
    with pytest.raises(ValueError, match="headroom must be a positive finite number"):
        Method(headroom=-1)


def test_stats_from_a_bad_file(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert cli.main(["calibrate", "--stats-from", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "not a --stats-json file" in capsys.readouterr().err


def test_k_channel_scales_are_written_read_back_and_lower_int4_error(smollm2, tmp_path, capsys):
    """kvq calibrate also writes each layer's K channel scales; k_channels_from= puts them on the
    int4 layers of a config (and refuses a config without one); on SmolLM2 they bring int4's
    perplexity closer to the model-dtype cache's than plain int4 (the study's 38% less KL)."""
    from torch_kvq.evaluation import corpus
    from torch_kvq.evaluation.calibrate import k_channel_scales
    from torch_kvq.evaluation.eval import EvalSettings, eval_data, teacher_forced_ppl
    from torch_kvq.integrations.hf_scales import checkpoint_k_channel_scales

    hf, tok = smollm2
    out = tmp_path / "kv.safetensors"
    argv = ["--model", "smollm2-135m", "--window", "128", "--windows", "2", "--out", str(out)]
    assert cli.main(["calibrate", *argv]) == 0
    assert "K channel scales (int4_per_token_head), scaled and centred, for 30" in (
        capsys.readouterr().out
    )
    paths = [f"model.layers.{i}.self_attn" for i in range(30)]
    channels = checkpoint_k_channel_scales(out, paths)
    assert list(channels) == paths and channels[paths[0]].shape == (3, 64)
    assert all(ch.mean is not None for ch in channels.values())
    settings = EvalSettings(window=128, windows=2, decode_tokens=0, prompts=1, prompt_tokens=1)
    windows = eval_data(tok, settings, corpus.split("eval")).windows
    ppl = {}
    for name, cfg, src in [
        ("bf16", KVCacheConfig(), None),
        ("int4", KVCacheConfig("int4_per_token_head"), None),
        ("int4s", KVCacheConfig("int4_per_token_head"), out),
        ("map", KVCacheConfig("auto", layer_modes={3: "int4_per_token_head"}), out),
    ]:
        lm = KVQCausalLM.from_hf(hf, cfg, num_pages=32, k_channels_from=src)
        try:
            scaled = [s.k_channel is not None for s in lm.kv_specs]
            assert scaled == (
                [i == 3 for i in range(30)] if name == "map" else [name == "int4s"] * 30
            )
            if name == "int4s":  # the same numbers as calibrating in process
                cal = eval_data(tok, settings, corpus.split("calibration")).windows
                again = k_channel_scales(lm, cal)
                assert again[paths[5]] == channels[paths[5]]
                lm.configure_kv(cfg if src is None else lm.with_k_channels(cfg, channels))
            ppl[name] = teacher_forced_ppl(lm, windows)
        finally:
            lm.detach()
    assert abs(ppl["int4s"] - ppl["bf16"]) < 0.6 * abs(ppl["int4"] - ppl["bf16"]), ppl
    with pytest.raises(ValueError, match="no layer of this KV config is int4_per_token_head"):
        KVQCausalLM.from_hf(hf, KVCacheConfig("fp8"), num_pages=4, k_channels_from=out)


def test_k_bases_are_written_read_back_and_beat_int4(smollm2, tmp_path, capsys):
    """kvq calibrate also writes each layer's K basis (``P.k_basis``); k_bases_from= puts them
    on the tc4 layers of a config (and refuses a config without one), the same bases as
    calibrating in process; on SmolLM2 tc4 on every layer brings perplexity far closer to the
    model-dtype cache's than int4 (151 bytes a token and kv head at D 128 against 136)."""
    from torch_kvq.evaluation import corpus
    from torch_kvq.evaluation.calibrate import k_bases
    from torch_kvq.evaluation.eval import EvalSettings, eval_data, teacher_forced_ppl
    from torch_kvq.integrations.hf_scales import checkpoint_k_bases

    hf, tok = smollm2
    out = tmp_path / "kv.safetensors"
    argv = ["--model", "smollm2-135m", "--window", "128", "--windows", "2", "--out", str(out)]
    assert cli.main(["calibrate", *argv]) == 0
    assert "K bases (tc4_per_token_head) for 30 layers" in capsys.readouterr().out
    paths = [f"model.layers.{i}.self_attn" for i in range(30)]
    bases = checkpoint_k_bases(out, paths)
    assert list(bases) == paths and bases[paths[0]].shape == (3, 64, 64)
    settings = EvalSettings(window=128, windows=2, decode_tokens=0, prompts=1, prompt_tokens=1)
    windows = eval_data(tok, settings, corpus.split("eval")).windows
    ppl = {}
    for name, cfg, src in [
        ("bf16", KVCacheConfig(), None),
        ("int4", KVCacheConfig("int4_per_token_head"), None),
        ("tc4", KVCacheConfig("tc4_per_token_head"), out),
        ("map", KVCacheConfig("auto", layer_modes={3: "tc4_per_token_head"}), out),
    ]:
        lm = KVQCausalLM.from_hf(hf, cfg, num_pages=32, k_bases_from=src)
        try:
            given = [s.k_basis is not None for s in lm.kv_specs]
            assert given == ([i == 3 for i in range(30)] if name == "map" else [name == "tc4"] * 30)
            if name == "map":  # the same bases as calibrating in process
                cal = eval_data(tok, settings, corpus.split("calibration")).windows
                assert k_bases(lm, cal)[paths[3]] == bases[paths[3]]
                lm.configure_kv(lm.with_k_bases(cfg, bases))
            ppl[name] = teacher_forced_ppl(lm, windows)
        finally:
            lm.detach()
    assert abs(ppl["tc4"] - ppl["bf16"]) < 0.4 * abs(ppl["int4"] - ppl["bf16"]), ppl
    with pytest.raises(ValueError, match="no layer of this KV config is tc4_per_token_head"):
        KVQCausalLM.from_hf(hf, KVCacheConfig("fp8"), num_pages=4, k_bases_from=out)
