"""Named KV presets (``torch_kvq.kv_presets``): the recommended 4-bit map per shipped model,
resolved on those models' layer shapes, and through ``kvq eval``'s ``--kv``."""

from __future__ import annotations

import pytest

from torch_kvq.evaluation.kv_arg import parse_kv
from torch_kvq.kv_presets import PRESETS, kv_preset
from torch_kvq.spec import AttentionLayerInfo
from torch_kvq.spec_resolve import resolve_layer_specs


def _smollm2() -> list[AttentionLayerInfo]:  # SmolLM2-135M: 30 full layers, 9 / 3 heads of 64
    return [AttentionLayerInfo(f"l{i}.attn", 9, 3, 64) for i in range(30)]


def _gemma3_270m() -> list[AttentionLayerInfo]:  # 18 layers, every 6th full, 4 / 1 heads of 256
    return [
        AttentionLayerInfo(f"l{i}.attn", 4, 1, 256, sliding_window=None if i % 6 == 5 else 512)
        for i in range(18)
    ]


def test_int4_recommended_on_smollm2() -> None:
    specs = resolve_layer_specs(kv_preset("int4-recommended", model="smollm2-135m"), _smollm2())
    k8v4 = [s.index for s in specs if s.mode.value == "k8v4_per_token_head"]
    assert k8v4 == [1, 3, 4, 6, 12, 13, 16, 22]
    rest = {s.mode.value for s in specs if s.index not in k8v4}
    assert rest == {"int4_per_token_head"}


def test_int4_recommended_on_gemma3_keeps_sliding_layers() -> None:
    cfg = kv_preset("int4-recommended", model="gemma3-270m", page_size=32)
    specs = resolve_layer_specs(cfg, _gemma3_270m())
    assert cfg.page_size == 32
    assert [s.index for s in specs if s.is_quantized] == [5, 11, 17]
    assert {s.mode.value for s in specs if s.is_quantized} == {"k8v4_per_token_head"}


def test_preset_page_size_is_its_own_unless_given() -> None:
    """int4-recommended's decode measured fastest at 32-token pages; a caller's page size wins."""
    assert PRESETS["int4-recommended"].page_size == 32
    assert kv_preset("int4-recommended", model="smollm2-135m").page_size == 32
    assert kv_preset("int4-recommended", model="smollm2-135m", page_size=16).page_size == 16
    with pytest.raises(ValueError, match="unsupported page_size 48"):
        kv_preset("int4-recommended", model="smollm2-135m", page_size=48)


def test_sensitive_layers_for_any_model() -> None:
    cfg = kv_preset("int4-recommended", sensitive_layers=[0, -1])
    specs = resolve_layer_specs(cfg, _smollm2())
    assert [s.index for s in specs if s.mode.value == "k8v4_per_token_head"] == [0, 29]


def test_every_preset_names_layers_that_exist() -> None:
    """Each measured model's layers resolve (a stale index would be a ValueError)."""
    layers = {"smollm2-135m": _smollm2(), "gemma3-270m": _gemma3_270m()}
    for preset in PRESETS.values():
        if preset.sensitive_mode is None:  # one map for every model
            assert not preset.measured
            continue
        assert set(preset.measured) == set(layers)
        for model in preset.measured:
            resolve_layer_specs(kv_preset(preset.name, model=model), layers[model])


def _with_bases(cfg, layers):
    """``cfg`` with an identity K basis on every full-attention layer (the preset carries none)."""
    from dataclasses import replace

    import torch

    from torch_kvq.spec_channels import KBasis

    bases = tuple(
        (i.name, KBasis.of(torch.eye(i.head_size).expand(i.num_kv_heads, -1, -1)))
        for i in layers
        if i.sliding_window is None
    )
    return replace(cfg, k_bases=bases)


def test_tc4_recommended_is_tc4_on_the_full_layers_of_any_model() -> None:
    """The map measured in docs/accuracy.md: tc4 on every full-attention layer (SmolLM2: all 30),
    sliding layers in the model dtype (Gemma-3: 5, 11, 17 quantized); no per-model layer list."""
    preset = PRESETS["tc4-recommended"]
    assert (preset.sensitive_mode, preset.tables, preset.page_size) == (None, ("basis",), 32)
    for layers, quantized in ((_smollm2(), list(range(30))), (_gemma3_270m(), [5, 11, 17])):
        cfg = kv_preset("tc4-recommended", model="any-model")
        specs = resolve_layer_specs(_with_bases(cfg, layers), layers)
        assert [s.index for s in specs if s.is_quantized] == quantized
        assert {s.mode.value for s in specs if s.is_quantized} == {"tc4_per_token_head"}
        assert all(s.k_basis is not None for s in specs if s.is_quantized)
    kv = parse_kv("t=tc4-recommended:basis=calibrate")
    assert (kv.preset, kv.basis, kv.channels) == ("tc4-recommended", "calibrate", None)
    assert kv.config(16, model="gemma3-270m") == kv_preset("tc4-recommended", page_size=16)


def test_kv_arg_resolves_a_preset_per_model() -> None:
    kv = parse_kv("rec=int4-recommended")
    assert kv.name == "rec" and kv.preset == "int4-recommended"
    assert kv.config(16, model="smollm2-135m") == kv_preset(
        "int4-recommended", model="smollm2-135m", page_size=16
    )
    with pytest.raises(ValueError, match="no measured layers for model 'other'"):
        kv.config(16, model="other")
