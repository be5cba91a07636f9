"""Per-layer specs of an attached HF model: skip rules on HF names and config layer types, layer
names and prefixes, and FP8-KV checkpoint scales read from a safetensors file."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests.support.hf_families import NUM_PAGES, PAGE_SIZE, hf_model
from torch_kvq import KVCacheConfig, KVQuantMode
from torch_kvq.integrations.transformers import KVQCausalLM

FP8 = KVQuantMode.FP8_PER_TENSOR


def attach(family: str = "gemma2", **kv: object) -> KVQCausalLM:
    cfg = KVCacheConfig("fp8", page_size=PAGE_SIZE, **kv)
    return KVQCausalLM.from_hf(hf_model(family, torch.bfloat16), cfg, num_pages=NUM_PAGES)


@pytest.mark.parametrize(
    "rule,skipped",
    [
        ("sliding_window", [0, 2]),  # layer_types: sliding, full, sliding, full
        ("full_attention", [1, 3]),
        (1, [1]),
        (-1, [3]),
        ("model.layers.[01].self_attn", [0, 1]),
        ("model.layers.2.self_attn", [2]),
    ],
)
def test_skip_rules_on_hf_names_and_layer_types(rule, skipped):
    lm = attach(skip_layers=(rule,))
    assert [s.index for s in lm.kv_specs if not s.is_quantized] == skipped
    for s, attn in zip(lm.kv_specs, lm.attention_layers):
        assert attn.kv_cache.dtype == (torch.float8_e4m3fn if s.is_quantized else torch.bfloat16)
        assert (s.skip_reason is None) == s.is_quantized


def test_bad_skip_rules_name_hf_layers():
    with pytest.raises(
        ValueError, match=r"matches no layer; layer names look like \['model.layers.0.self_attn'"
    ):
        attach(skip_layers=("model.decoder.*",))
    with pytest.raises(ValueError, match="out of range for a model with 4 attention layers"):
        attach(skip_layers=(4,))


def test_second_model_gets_a_prefix_and_configure_kv_replaces_caches():
    a = attach()
    b = attach()
    assert a.kv_specs[0].name == "model.layers.0.self_attn"
    assert b.kv_specs[0].name == "model_1.layers.0.self_attn"
    assert b.layer_paths["model_1.layers.0.self_attn"] == "model.layers.0.self_attn"
    c = KVQCausalLM.from_hf(hf_model("llama"), KVCacheConfig(), num_pages=4, prefix="mine")
    assert [s.name for s in c.kv_specs][:1] == ["mine.layers.0.self_attn"]
    old = a.attention_layers
    a.configure_kv(KVCacheConfig(page_size=8))
    assert all(s.mode is KVQuantMode.NONE for s in a.kv_specs)
    assert all(x is not y for x, y in zip(old, a.attention_layers))
    assert a.allocator.page_size == 8


LAYOUTS = {  # how FP8-KV exporters name the per-layer scales under the attention module
    "compressed-tensors": ("{}.k_scale", "{}.v_scale"),
    "modelopt": ("{}.k_proj.k_scale", "{}.v_proj.v_scale"),
    "output-scale": ("{}.k_proj.output_scale", "{}.v_proj.output_scale"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoint_kv_scales_load_into_specs(tmp_path, layout):
    k_key, v_key = LAYOUTS[layout]
    tensors = {}
    for i in range(4):
        path = f"model.layers.{i}.self_attn"
        tensors[k_key.format(path)] = torch.tensor(0.01 * (i + 1), dtype=torch.float32)
        tensors[v_key.format(path)] = torch.tensor([0.002 * (i + 1)], dtype=torch.bfloat16)
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(2, 2)  # other keys are ignored
    save_file(tensors, tmp_path / "model-00001-of-00001.safetensors")
    lm = KVQCausalLM.from_hf(
        hf_model("llama", torch.bfloat16),
        KVCacheConfig("fp8", skip_layers=(0,), page_size=PAGE_SIZE),
        num_pages=NUM_PAGES,
        kv_scales_from=tmp_path,  # a folder; a file or a state dict work too
    )
    for s in lm.kv_specs[1:]:
        assert s.mode is FP8
        assert s.k_scale == pytest.approx(0.01 * (s.index + 1))
        assert s.v_scale == pytest.approx(0.002 * (s.index + 1), rel=1e-2)  # stored in bf16
    assert (lm.kv_specs[0].k_scale, lm.kv_specs[0].v_scale) == (1.0, 1.0)  # skipped: unused


def test_checkpoint_kv_scale_both_and_refusals(tmp_path):
    hf = hf_model("llama", torch.bfloat16)
    both = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.5) for i in range(4)}
    lm = KVQCausalLM.from_hf(hf, KVCacheConfig("fp8"), num_pages=4, kv_scales_from=both)
    assert {(s.k_scale, s.v_scale) for s in lm.kv_specs} == {(0.5, 0.5)}
    lm.detach()
    per_head = {
        "model.layers.0.self_attn.k_scale": torch.ones(2),
        "model.layers.0.self_attn.v_scale": torch.ones(2),
    }
    with pytest.raises(ValueError, match="only per-tensor"):
        KVQCausalLM.from_hf(hf, KVCacheConfig("fp8"), num_pages=4, kv_scales_from=per_head)
    with pytest.raises(ValueError, match="no KV scales in the checkpoint"):
        KVQCausalLM.from_hf(hf, KVCacheConfig("fp8"), num_pages=4, kv_scales_from={})
    with pytest.raises(ValueError, match="no safetensors checkpoint"):
        KVQCausalLM.from_hf(hf, KVCacheConfig("fp8"), num_pages=4, kv_scales_from=tmp_path)
