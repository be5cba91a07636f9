"""Issue 32: the per-(token, head) modes' spec properties and the per-layer mode map."""

from __future__ import annotations

import pytest
import torch

from torch_kvq.attention.memory import max_seqs_for_budget, page_bytes, plan_kv_memory
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig
from torch_kvq.spec_modes import FP8_DTYPE, KVQuantMode, parse_kv_cache_dtype
from torch_kvq.spec_resolve import resolve_layer_specs
from torch_kvq.spec_table import format_spec_table, skip_rule_notes


def layers(n: int = 6) -> list[AttentionLayerInfo]:
    """Gemma-like: every third layer global, the others sliding (window 16)."""
    return [
        AttentionLayerInfo(f"model.layers.{i}.self_attn.attn", 8, 2, 32, None if i % 3 == 2 else 16)
        for i in range(n)
    ]


def modes(cfg: KVCacheConfig) -> list[str]:
    return [s.mode.value for s in resolve_layer_specs(cfg, layers())]


@pytest.mark.parametrize(
    "mode, code, qmax, fmt",
    [
        (KVQuantMode.INT8_PER_TOKEN_HEAD, torch.int8, 127.0, "int8"),
        (KVQuantMode.FP8_PER_TOKEN_HEAD, FP8_DTYPE, 448.0, "fp8"),
        (KVQuantMode.INT4_PER_TOKEN_HEAD, torch.uint8, 15.0, "int4"),
        (KVQuantMode.K8V4_PER_TOKEN_HEAD, torch.uint8, None, "k8v4"),  # k and v differ
    ],
)
def test_per_token_head_mode_properties(mode, code, qmax, fmt) -> None:
    assert KVQuantMode(mode.value) is mode and mode.is_quantized and mode.per_token_head
    assert (mode.code_dtype, mode.qmax, mode.per_token_head_format) == (code, qmax, fmt)
    assert parse_kv_cache_dtype(mode.value, torch.bfloat16) == (mode, code)


def test_qmax_and_code_dtypes_agree_with_the_quant_math() -> None:
    from torch_kvq.attention.quant import FP8_MAX, PER_TOKEN_HEAD_FORMATS, cache_layout, kv_formats

    assert KVQuantMode.FP8_PER_TENSOR.qmax == FP8_MAX
    for mode in (m for m in KVQuantMode if m.per_token_head):
        fmt = mode.per_token_head_format
        assert kv_formats(fmt) == (mode.k_format, mode.v_format)
        assert cache_layout(fmt) == (mode.code_dtype, mode.cache_slots, mode.codes_per_byte)
        if mode.k_format == mode.v_format:
            assert PER_TOKEN_HEAD_FORMATS[fmt] == (mode.code_dtype, mode.qmax)


def test_older_modes_have_no_per_token_head_format() -> None:
    assert not KVQuantMode.FP8_PER_TENSOR.per_token_head
    assert KVQuantMode.FP8_PER_TENSOR.code_dtype == FP8_DTYPE
    assert KVQuantMode.NONE.code_dtype is None and KVQuantMode.NONE.qmax is None
    with pytest.raises(ValueError, match="mode 'fp8_per_tensor' has no per-.token, head. format"):
        _ = KVQuantMode.FP8_PER_TENSOR.per_token_head_format


def test_cache_bytes_count_codes_and_scales() -> None:
    spec = resolve_layer_specs(KVCacheConfig("int8_per_token_head"), layers(1))[0]
    kh, d = 2, 32
    assert spec.storage_dtype == torch.int8
    assert spec.scale_bytes_per_token == 2 * kh * 4
    assert spec.cache_bytes_per_token == 2 * kh * d * 1 + 2 * kh * 4
    assert page_bytes(spec) == spec.page_size * spec.cache_bytes_per_token
    fp8 = resolve_layer_specs(KVCacheConfig("fp8"), layers(1))[0]
    assert fp8.scale_bytes_per_token == 0 and fp8.cache_bytes_per_token == 2 * kh * d
    # the planner counts the scales: the same pages cost more bytes than per-tensor FP8
    plan_pth = plan_kv_memory([spec], max_seqs=2, max_context=64, windowed=False)
    plan_fp8 = plan_kv_memory([fp8], max_seqs=2, max_context=64, windowed=False)
    assert plan_pth.num_pages == plan_fp8.num_pages
    assert plan_pth.bytes == plan_pth.num_pages * 16 * (2 * kh * d + 2 * kh * 4)
    assert plan_pth.bytes > plan_fp8.bytes
    # a budget that holds 2 FP8 sequences of 64 tokens (+1 reserve page) holds 1 with scales
    budget = plan_fp8.bytes
    assert max_seqs_for_budget([fp8], budget, 64, windowed=False).max_seqs == 2
    assert max_seqs_for_budget([spec], budget, 64, windowed=False).max_seqs == 1


def test_the_issue_example_map() -> None:
    """Default int8_per_token_head, sliding layers auto, layers 0 and -1 fp8."""
    cfg = KVCacheConfig(
        "int8_per_token_head",
        layer_modes=(("sliding_window", "auto"), (0, "fp8"), (-1, "fp8")),
    )
    with pytest.raises(ValueError, match=r"layer 0 .*two modes: 'auto' by layer_modes rule "
                       r"'sliding_window' and 'fp8' by layer_modes rule 0"):  # fmt: skip
        resolve_layer_specs(cfg, layers())
    cfg = KVCacheConfig(
        "int8_per_token_head", layer_modes=(("sliding_window", "auto"), (-1, "fp8"))
    )
    specs = resolve_layer_specs(cfg, layers())
    assert [s.mode.value for s in specs] == [
        "none", "none", "int8_per_token_head", "none", "none", "fp8_per_tensor"
    ]  # fmt: skip
    assert [s.storage_dtype for s in specs][2] == torch.int8
    assert specs[0].skip_reason == "layer_modes rule 'sliding_window'"
    assert specs[2].skip_reason is None and specs[5].skip_reason is None


@pytest.mark.parametrize(
    "rule, layer_ids",
    [(1, {1}), (-2, {4}), ("full_attention", {2, 5}), ("model.layers.[34]*", {3, 4}),
     ("model.layers.4.self_attn.attn", {4}), ("sliding_window", {0, 1, 3, 4})],
)  # fmt: skip
def test_every_rule_form_selects_its_layers(rule, layer_ids) -> None:
    got = modes(KVCacheConfig("auto", layer_modes=((rule, "fp8_per_token_head"),)))
    assert {i for i, m in enumerate(got) if m == "fp8_per_token_head"} == layer_ids
    assert {i for i, m in enumerate(got) if m == "none"} == set(range(6)) - layer_ids


def test_skip_layers_are_rules_with_mode_auto() -> None:
    both = KVCacheConfig("fp8", skip_layers=(0,), layer_modes=((2, "int8_per_token_head"),))
    assert modes(both) == ["none", "fp8_per_tensor", "int8_per_token_head"] + ["fp8_per_tensor"] * 3
    agree = KVCacheConfig("fp8", skip_layers=(0,), layer_modes=((0, "auto"),))
    assert modes(agree)[0] == "none"  # two rules, one mode: no conflict
    clash = KVCacheConfig("fp8", skip_layers=("sliding_window",), layer_modes=((0, "fp8"),))
    with pytest.raises(
        ValueError,
        match=r"layer 0 \('model.layers.0.self_attn.attn'\) is given two modes: 'fp8' by "
        r"layer_modes rule 0 and 'auto' by skip_layers rule 'sliding_window'",
    ):
        resolve_layer_specs(clash, layers())


def test_same_mode_spelled_twice_is_no_conflict() -> None:
    cfg = KVCacheConfig("auto", layer_modes=((0, "fp8"), ("model.layers.0*", "fp8_e4m3")))
    assert modes(cfg)[0] == "fp8_per_tensor"


def test_layer_modes_accepts_a_mapping() -> None:
    cfg = KVCacheConfig("auto", layer_modes={0: "int8_per_token_head"})
    assert cfg.layer_modes == ((0, "int8_per_token_head"),)
    assert cfg.rules == (0,)


@pytest.mark.parametrize(
    "layer_modes, match",
    [
        (((0, "int4"),), r"unknown kv_cache_dtype 'int4'"),
        (((1.5, "fp8"),), r"unknown skip rule 1.5"),
        (((0, "fp8"), (0, "auto")), r"layer_modes lists rule 0 more than once"),
        (((0,),), r"layer_modes entry \(0,\) must be a \(rule, kv_cache_dtype string\) pair"),
    ],
)
def test_bad_layer_modes(layer_modes, match) -> None:
    with pytest.raises(ValueError, match=match):
        KVCacheConfig("auto", layer_modes=layer_modes)


@pytest.mark.parametrize(
    "rule, match",
    [
        (6, r"layer_modes index 6 is out of range"),
        ("model.nothing.*", r"layer_modes glob 'model.nothing.\*' matches no layer"),
        ("model.layers.9", r"unknown skip rule 'model.layers.9'"),
    ],
)
def test_layer_modes_rules_that_select_nothing_are_errors(rule, match) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_layer_specs(KVCacheConfig("auto", layer_modes=((rule, "fp8"),)), layers())


def test_a_type_rule_that_matches_nothing_is_a_note() -> None:
    llama = [AttentionLayerInfo(f"l.{i}", 8, 2, 32) for i in range(3)]
    cfg = KVCacheConfig("int8_per_token_head", layer_modes=(("sliding_window", "auto"),))
    specs = resolve_layer_specs(cfg, llama)
    assert all(s.mode is KVQuantMode.INT8_PER_TOKEN_HEAD for s in specs)
    note = (
        "note: layer_modes rule 'sliding_window' (mode 'auto') matches no layer (this model has "
        "no sliding-window layers)"
    )
    assert skip_rule_notes((), specs, cfg.layer_modes) == [note]
    assert format_spec_table(specs, layer_modes=cfg.layer_modes).splitlines()[-1] == note


def test_unquantized_mode_must_match_the_model_dtype() -> None:
    cfg = KVCacheConfig("auto", layer_modes=((0, "float16"),))
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'float16' .* does not match the model"):
        resolve_layer_specs(cfg, layers(), torch.bfloat16)


def test_per_tensor_scales_for_a_per_token_head_layer_are_an_error() -> None:
    ok = KVCacheConfig(
        "int8_per_token_head", layer_modes=((0, "fp8"),), kv_scales=((0, (0.5, 0.25)),)
    )
    specs = resolve_layer_specs(ok, layers())
    assert (specs[0].k_scale, specs[0].v_scale) == (0.5, 0.25)
    assert (specs[1].k_scale, specs[1].v_scale) == (1.0, 1.0)
    bad = KVCacheConfig("int8_per_token_head", kv_scales=((1, (0.5, 0.25)),))
    with pytest.raises(
        ValueError,
        match=r"kv_scales gives per-tensor scales for layer 'model.layers.1.self_attn.attn', "
        r"whose mode 'int8_per_token_head' computes a scale per \(token, kv head\)",
    ):
        resolve_layer_specs(bad, layers())


def test_spec_table_shows_every_mode_and_the_scale_bytes() -> None:
    cfg = KVCacheConfig(
        "int8_per_token_head",
        layer_modes=((0, "fp8"), (1, "fp8_per_token_head"), ("sliding_window", "auto")),
    )
    with pytest.raises(ValueError, match="two modes"):
        resolve_layer_specs(cfg, layers())
    cfg = KVCacheConfig(
        "int8_per_token_head", layer_modes=((0, "fp8"), (1, "fp8_per_token_head"), (3, "auto"))
    )
    specs = resolve_layer_specs(cfg, layers())
    table = format_spec_table(specs).split("\n\n")[0]  # the notes follow a blank line
    rows = [r.split() for r in table.splitlines()[2:]]
    assert [r[3] for r in rows] == [
        "fp8_per_tensor", "fp8_per_token_head", "int8_per_token_head", "none",
        "int8_per_token_head", "int8_per_token_head",
    ]  # fmt: skip
    header = format_spec_table(specs).splitlines()[0]
    assert "scale bytes/token" in header
    assert rows[1][5:7] == [str(2 * 2 * 32 + 16), "16"]  # bytes/token, scale bytes/token
    assert rows[3][5:7] == [str(2 * 2 * 32 * 2), "0"]
    assert rows[2][-2:] == ["per", "token"]
