"""KVCacheConfig parsing, skip rules and resolve_layer_specs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig, LayerKVSpec
from torch_kvq.spec_modes import FP8_DTYPE, KVQuantMode, parse_kv_cache_dtype
from torch_kvq.spec_resolve import resolve_layer_specs
from torch_kvq.spec_table import format_spec_table, scale_notes, skip_rule_notes, spec_table_key


def layers(n: int = 6, window_every: int = 3) -> list[AttentionLayerInfo]:
    """Gemma-like: layers with index % window_every != window_every - 1 are sliding."""
    return [
        AttentionLayerInfo(
            f"model.layers.{i}.self_attn.attn",
            num_heads=8,
            num_kv_heads=2,
            head_size=32,
            sliding_window=None if i % window_every == window_every - 1 else 16,
        )
        for i in range(n)
    ]


def test_mode_values_are_strings() -> None:
    assert KVQuantMode("none") is KVQuantMode.NONE
    assert KVQuantMode("fp8_per_tensor") is KVQuantMode.FP8_PER_TENSOR
    assert all(isinstance(m.value, str) for m in KVQuantMode)
    assert KVQuantMode.FP8_PER_TENSOR.is_quantized and not KVQuantMode.NONE.is_quantized


@pytest.mark.parametrize(
    "name, mode, dtype",
    [
        ("auto", KVQuantMode.NONE, torch.bfloat16),
        ("bfloat16", KVQuantMode.NONE, torch.bfloat16),
        ("float16", KVQuantMode.NONE, torch.float16),
        ("fp8", KVQuantMode.FP8_PER_TENSOR, FP8_DTYPE),
        ("fp8_e4m3", KVQuantMode.FP8_PER_TENSOR, FP8_DTYPE),
        ("FP8", KVQuantMode.FP8_PER_TENSOR, FP8_DTYPE),
    ],
)
def test_parse_kv_cache_dtype(name: str, mode: KVQuantMode, dtype: torch.dtype) -> None:
    assert parse_kv_cache_dtype(name, torch.bfloat16) == (mode, dtype)


def test_auto_follows_model_dtype() -> None:
    assert parse_kv_cache_dtype("auto", torch.float16) == (KVQuantMode.NONE, torch.float16)


@pytest.mark.parametrize("bad", ["fp9", "int8", "", "fp8_e5m2"])
def test_unknown_dtype_is_rejected_with_the_accepted_forms(bad: str) -> None:
    with pytest.raises(ValueError, match=r"unknown kv_cache_dtype .*expected one of .*'fp8'"):
        KVCacheConfig(kv_cache_dtype=bad)


def test_mixed_config_resolves_per_layer() -> None:
    cfg = KVCacheConfig("fp8", skip_layers=("sliding_window",))
    specs = resolve_layer_specs(cfg, layers())
    assert [s.mode for s in specs] == [
        KVQuantMode.NONE if s.sliding_window else KVQuantMode.FP8_PER_TENSOR for s in specs
    ]
    for s in specs:
        assert s.storage_dtype == (torch.bfloat16 if s.sliding_window else FP8_DTYPE)
        assert s.model_dtype == torch.bfloat16
        assert (s.skip_reason is not None) == (s.sliding_window is not None)
    fp8 = next(s for s in specs if s.is_quantized)
    bf16 = next(s for s in specs if not s.is_quantized)
    assert fp8.cache_bytes_per_token * 2 == bf16.cache_bytes_per_token


@pytest.mark.parametrize(
    "rules, skipped",
    [
        ((0,), {0}),
        ((-1,), {5}),
        ((0, -1), {0, 5}),
        (("full_attention",), {2, 5}),
        (("model.layers.1*",), {1}),
        (("model.layers.[34].self_attn.attn",), {3, 4}),
        (("model.layers.4.self_attn.attn",), {4}),
        (("sliding_window", 2), {0, 1, 2, 3, 4}),
    ],
)
def test_skip_rules(rules: tuple, skipped: set[int]) -> None:
    specs = resolve_layer_specs(KVCacheConfig("fp8", skip_layers=rules), layers())
    assert {s.index for s in specs if not s.is_quantized} == skipped


def test_single_rule_not_in_tuple_is_accepted() -> None:
    assert KVCacheConfig("fp8", skip_layers="sliding_window").skip_layers == ("sliding_window",)


@pytest.mark.parametrize("bad", ["slidng_window", "layers.99", "full"])
def test_unknown_skip_rule_lists_accepted_forms(bad: str) -> None:
    with pytest.raises(
        ValueError, match=rf"unknown skip rule '{bad}'.*Accepted forms:.*sliding_window"
    ):
        resolve_layer_specs(KVCacheConfig("fp8", skip_layers=(bad,)), layers())


@pytest.mark.parametrize("bad", [1.5, None, True, b"x"])
def test_skip_rule_of_wrong_type(bad: object) -> None:
    with pytest.raises(ValueError, match="skip rule"):
        KVCacheConfig("fp8", skip_layers=(bad,))


@pytest.mark.parametrize("bad", [6, -7, 100])
def test_out_of_range_index_is_an_error(bad: int) -> None:
    with pytest.raises(
        ValueError, match=rf"index {bad} is out of range for a model with 6 attention layers"
    ):
        resolve_layer_specs(KVCacheConfig("fp8", skip_layers=(bad,)), layers())


def test_duplicate_index_is_an_error() -> None:
    with pytest.raises(ValueError, match="more than once"):
        resolve_layer_specs(KVCacheConfig("fp8", skip_layers=(1, -5)), layers())


def test_glob_matching_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="matches no layer"):
        resolve_layer_specs(KVCacheConfig("fp8", skip_layers=("decoder.*",)), layers())


@pytest.mark.parametrize("bad", [0, 3, 256, -16, True])
def test_unsupported_page_size(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"unsupported page_size {bad!r}; expected one of"):
        KVCacheConfig(page_size=bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, "1.0"])
def test_bad_scales(bad: object) -> None:
    with pytest.raises(ValueError, match="positive finite float"):
        KVCacheConfig("fp8", default_k_scale=bad)
    with pytest.raises(ValueError, match="positive finite float"):
        KVCacheConfig("fp8", kv_scales={0: (1.0, bad)})


def test_per_layer_scales_by_index_and_name() -> None:
    cfg = KVCacheConfig(
        "fp8", kv_scales={2: (0.5, 0.25), "model.layers.5.self_attn.attn": (2.0, 3.0)}
    )
    specs = resolve_layer_specs(cfg, layers())
    assert (specs[2].k_scale, specs[2].v_scale) == (0.5, 0.25)
    assert (specs[5].k_scale, specs[5].v_scale) == (2.0, 3.0)
    assert (specs[0].k_scale, specs[0].v_scale) == (1.0, 1.0)


def test_scales_for_unknown_layer_or_twice() -> None:
    with pytest.raises(ValueError, match="unknown layer 'nope'"):
        resolve_layer_specs(KVCacheConfig("fp8", kv_scales={"nope": (1.0, 1.0)}), layers())
    cfg = KVCacheConfig(
        "fp8", kv_scales={0: (1.0, 1.0), "model.layers.0.self_attn.attn": (2.0, 2.0)}
    )
    with pytest.raises(ValueError, match="twice"):
        resolve_layer_specs(cfg, layers())


def test_dtype_that_disagrees_with_model() -> None:
    with pytest.raises(ValueError, match="does not match the model dtype"):
        resolve_layer_specs(KVCacheConfig("float16"), layers(), torch.bfloat16)


def test_bad_layer_info() -> None:
    bad = [AttentionLayerInfo("a", num_heads=6, num_kv_heads=4, head_size=32)]
    with pytest.raises(ValueError, match="not a multiple"):
        resolve_layer_specs(KVCacheConfig(), bad)
    dup = [AttentionLayerInfo("a", 4, 2, 32), AttentionLayerInfo("a", 4, 2, 32)]
    with pytest.raises(ValueError, match="duplicate attention layer names"):
        resolve_layer_specs(KVCacheConfig(), dup)


def test_specs_are_frozen_and_hashable() -> None:
    specs = resolve_layer_specs(KVCacheConfig("fp8"), layers())
    with pytest.raises(dataclasses.FrozenInstanceError):
        specs[0].mode = KVQuantMode.NONE  # type: ignore[misc]
    assert len(set(specs)) == len(specs)
    assert isinstance(specs[0], LayerKVSpec)
    hash(KVCacheConfig("fp8", skip_layers=[0, "sliding_window"]))


def test_directly_built_spec_gets_the_real_softmax_scale() -> None:
    """No silent 0.0 (uniform attention): left out, sm_scale is 1 / sqrt(head_size), stored."""
    args = ("x", 0, KVQuantMode.NONE, torch.bfloat16, torch.bfloat16, 4, 2, 64, 16)
    assert LayerKVSpec(*args).sm_scale == 64**-0.5 == 0.125
    assert LayerKVSpec(*args, sm_scale=1).sm_scale == 1.0
    assert dataclasses.replace(LayerKVSpec(*args), sm_scale=0.5).sm_scale == 0.5
    for bad in (0.0, -0.1, math.nan, math.inf, "0.1"):
        with pytest.raises(ValueError, match="layer 'x': sm_scale must be a positive finite float"):
            LayerKVSpec(*args, sm_scale=bad)
    (resolved,) = resolve_layer_specs(KVCacheConfig(), [AttentionLayerInfo("x", 4, 2, 64)])
    assert resolved.sm_scale == 0.125


def test_spec_table_key_changes_with_config() -> None:
    a = spec_table_key(resolve_layer_specs(KVCacheConfig("fp8"), layers()))
    b = spec_table_key(resolve_layer_specs(KVCacheConfig("fp8", skip_layers=(0,)), layers()))
    c = spec_table_key(resolve_layer_specs(KVCacheConfig("fp8", default_k_scale=0.5), layers()))
    assert len({a, b, c}) == 3
    assert a == spec_table_key(resolve_layer_specs(KVCacheConfig("fp8"), layers()))


def test_table_shows_both_modes_and_dtypes() -> None:
    specs = resolve_layer_specs(KVCacheConfig("fp8", skip_layers=("sliding_window",)), layers(3))
    table = format_spec_table(specs, extra={specs[2].name: {"fused": "quant+write"}})
    lines = table.splitlines()
    assert "mode" in lines[0] and "fused" in lines[0]
    assert (
        "fp8_per_tensor" in lines[4] and "float8_e4m3fn" in lines[4] and "quant+write" in lines[4]
    )
    assert "none" in lines[2] and "bfloat16" in lines[2] and "sliding(16)" in lines[2]


def uniform(n: int, window: int | None) -> list[AttentionLayerInfo]:
    """n layers that all have ``window`` (a Mistral) or none (a Llama)."""
    return [AttentionLayerInfo(f"m.layers.{i}.attn", 8, 2, 32, window) for i in range(n)]


@pytest.mark.parametrize(
    "window, rules, note",
    [
        (None, ("sliding_window",), "note: skip rule 'sliding_window' matches no layer (this "
         "model has no sliding-window layers): every layer is quantized"),
        (None, ("sliding_window", 0), "note: skip rule 'sliding_window' matches no layer (this "
         "model has no sliding-window layers)"),
        (None, ("full_attention",), "note: skip rule 'full_attention' matches every layer (this "
         "model has no sliding-window layers): no layer is quantized"),
        (4096, ("sliding_window",), "note: skip rule 'sliding_window' matches every layer (every "
         "layer of this model has a sliding window): no layer is quantized"),
        (4096, ("full_attention",), "note: skip rule 'full_attention' matches no layer (every "
         "layer of this model has a sliding window): every layer is quantized"),
    ],
)  # fmt: skip
def test_a_type_rule_that_matches_no_layer_or_every_layer_is_noted(window, rules, note) -> None:
    specs = resolve_layer_specs(KVCacheConfig("fp8", skip_layers=rules), uniform(3, window))
    assert skip_rule_notes(rules, specs) == [note]
    table = format_spec_table(specs, skip_layers=rules).splitlines()
    # after the table, a blank line between; then the scale note (these scales are the default)
    after = ["", note, *scale_notes(specs)]
    assert table[-len(after) :] == after


def test_no_note_when_the_rules_split_the_layers_or_nothing_is_quantized() -> None:
    rules = ("sliding_window",)
    gemma = resolve_layer_specs(KVCacheConfig("fp8", skip_layers=rules), layers())
    assert skip_rule_notes(rules, gemma) == []
    auto = resolve_layer_specs(KVCacheConfig("auto", skip_layers=rules), uniform(3, None))
    assert skip_rule_notes(rules, auto) == []
    assert "note: skip rule" not in format_spec_table(gemma, skip_layers=rules)


def test_a_default_scale_is_said_uncalibrated() -> None:
    """A quantized layer on the default scales 1.0 with no kv_scales entry is 'uncalibrated' in
    the spec, the table and a note; a given scale (or a chosen default) is not."""
    specs = resolve_layer_specs(KVCacheConfig("fp8", kv_scales={1: (0.5, 0.25)}), layers(3))
    assert [s.uncalibrated for s in specs] == [True, False, True]
    assert scale_notes(specs) == [
        "note: scale 1.0, uncalibrated: layers 0, 2 (no kv_scales given); k / v beyond +-448 are "
        "clamped (an eager run warns); kvq calibrate writes scales, kv_scales_from= reads them"
    ]
    table = format_spec_table(specs)
    assert table.count("1 uncalibrated") == 4 and "0.5 " in table
    chosen = resolve_layer_specs(KVCacheConfig("fp8", default_k_scale=2.0), layers(2))
    assert not any(s.uncalibrated for s in chosen) and scale_notes(chosen) == []
    auto = resolve_layer_specs(KVCacheConfig("auto"), layers(2))
    assert not any(s.uncalibrated for s in auto) and scale_notes(auto) == []


def test_table_columns_pick_and_keep_the_table_order() -> None:
    specs = resolve_layer_specs(KVCacheConfig("fp8"), layers(2))
    extra = {s.name: {"fused": "x"} for s in specs}
    table = format_spec_table(specs, extra, columns=("fused", "idx", "mode")).splitlines()
    assert table[0].split() == ["idx", "mode", "fused"]
    assert table[2].split() == ["0", "fp8_per_tensor", "x"]
    with pytest.raises(ValueError, match=r"unknown table columns \['bytes'\]; the table has"):
        format_spec_table(specs, columns=("idx", "bytes"))
