"""``kvq inspect --hf-config`` (a config.json on the meta device: no weights) and
``kvq demo --hf FAMILY`` (a tiny random-weight transformers model)."""

from __future__ import annotations

import json

from tests.support.cli import run_main
from torch_kvq.integrations.hf_tiny import tiny_hf_config


def test_inspect_hf_config_plans_every_layer_without_weights(capsys, tmp_path):
    big = dict(hidden_size=4096, intermediate_size=16384, head_dim=128, num_attention_heads=32)
    tiny_hf_config("gemma3", num_key_value_heads=16, **big).save_pretrained(tmp_path)
    code, out, err = run_main(capsys, "inspect", "--hf-config", str(tmp_path), "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["name"] for r in rows] == [f"model.layers.{i}.self_attn" for i in range(4)]
    assert [r["mode"] for r in rows] == ["none", "none", "fp8_per_tensor", "none"]
    assert {(r["num_heads"], r["num_kv_heads"], r["head_size"]) for r in rows} == {(32, 16, 128)}
    code, out, err = run_main(capsys, "inspect", "--hf-config", str(tmp_path / "config.json"))
    assert code == 0 and "1 of 4 layers quantized" in out, err


def test_inspect_hf_config_missing(capsys, tmp_path):
    code, _, err = run_main(capsys, "inspect", "--hf-config", str(tmp_path))
    assert code == 2 and "no such config.json (nothing is downloaded)" in err, err


def test_demo_hf_family(capsys):
    code, out, err = run_main(capsys, "demo", "--hf", "qwen2", "--max-new-tokens", "2")
    assert code == 0, err
    flat = " ".join(out.split())  # the report wraps its line
    assert "transformers qwen2" in out and "fused quant+write 2, dequant+attn 2" in flat, out
    assert "max |logit diff| vs the all-bfloat16 cache" in out and "next-token agreement" in out


def test_accuracy_on_a_tiny_hf_model(capsys):
    """``kvq accuracy --hf``: the per-layer FP8 error table of a transformers model."""
    code, out, err = run_main(capsys, "accuracy", "--hf", "qwen2")
    assert code == 0, err
    assert "transformers qwen2 (tiny, random weights)" in out
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [r[1] for r in rows] == [f"model.layers.{i}.self_attn" for i in range(4)]
    assert [r[2] for r in rows] == ["sliding", "global"] * 2
    assert [r[3] for r in rows] == ["kept", "fp8_per_tensor"] * 2  # "kept bf16"


def test_dump_on_a_tiny_hf_model(capsys, tmp_path):
    """``kvq dump --hf``: per-pass dumps of a transformers model; its FP8 layer fused."""
    out_dir = tmp_path / "dump"
    argv = ("dump", "--hf", "gemma3", "--out", str(out_dir), "--no-depyf", "--inner", "eager")
    code, out, err = run_main(capsys, *argv)
    assert code == 0, err
    assert (out_dir / "index.html").is_file() and (out_dir / "plan.txt").is_file()
    plan, caches = (out_dir / "plan.txt").read_text().split("caches of this model:\n")
    fp8 = plan.count("fp8_per_tensor")
    assert "model.layers.0.self_attn" in plan and fp8 >= 1
    assert caches.count("fp8_per_tensor") == fp8  # the caches the model holds, one line a layer
    after = [line for line in out.splitlines() if line.startswith("ops after:")]
    assert after and all(f"'kvq.quant_cache_write': {fp8}" in a for a in after), out
    assert all("dequantize_kv_cache" not in a for a in after), out


def test_every_subcommand_takes_one_model_source(capsys):
    """``--preset`` | ``--hf`` | ``--hf-config``: one mutually exclusive group on every
    subcommand; ``kvq inspect --hf`` plans a tiny family."""
    for sub in ("demo", "inspect", "dump", "accuracy"):
        code, _, err = run_main(capsys, sub, "--preset", "llama-tiny", "--hf", "qwen2")
        assert code == 2 and "argument --hf: not allowed with argument --preset" in err, err
        code, _, err = run_main(capsys, sub, "--hf", "qwen2", "--hf-config", "x")
        assert code == 2 and "not allowed with argument --hf" in err, err
    code, out, err = run_main(capsys, "inspect", "--hf", "qwen2")
    assert code == 0, err
    assert "kvq inspect: transformers qwen2 (tiny, random weights)" in out
    assert "2 of 4 layers quantized" in out


def test_hf_config_without_weights_is_for_inspect_only(capsys, tmp_path):
    tiny_hf_config("llama").save_pretrained(tmp_path)
    code, out, err = run_main(capsys, "demo", "--hf-config", str(tmp_path))
    assert code == 2 and not out
    assert err.startswith("kvq demo: error: --hf-config") and "only kvq inspect" in err, err
    code, out, err = run_main(capsys, "inspect", "--hf-config", str(tmp_path), "--head-dim", "64")
    assert code == 0, err
    assert "LlamaForCausalLM" in out.splitlines()[0]
    assert "(all-bfloat16: 2048)" in out  # 4 layers x 2 KV heads x head size 64 x (k, v) x 2 B


def test_mistral_every_layer_sliding_keeps_every_layer_bf16_and_says_so(capsys):
    code, out, err = run_main(capsys, "inspect", "--hf", "mistral")
    assert code == 0, err
    assert (
        "note: skip rule 'sliding_window' matches every layer (every layer of this model has a "
        "sliding window): no layer is quantized"
    ) in " ".join(out.split())
    assert "0 of 4 layers quantized" in out


def test_hf_config_failures_are_clean_errors(capsys, tmp_path):
    """transformers' own failures on a config: ``kvq inspect: error: ...``, exit 2, naming the
    file, no traceback and no list of transformers' classes."""
    import transformers

    t5 = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2
    )
    t5.save_pretrained(tmp_path / "t5")
    code, out, err = run_main(capsys, "inspect", "--hf-config", str(tmp_path / "t5"))
    assert code == 2 and not out
    assert err.startswith("kvq inspect: error: --hf-config") and "Traceback" not in err, err
    assert "encoder-decoder is not supported" in err and "should be one of" not in err, err
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 64,,}')
    code, out, err = run_main(capsys, "inspect", "--hf-config", str(bad))
    assert code == 2 and not out
    assert f"kvq inspect: error: --hf-config: {str(bad)!r} is not a JSON config: " in err, err
