"""Issue 32's passes: the per-(token, head) write and attention fusions (the ops and the
torch-native form, bit for bit), annotate's per-mode checks, and the seed bug generalized: a
Gemma-3-shaped model with three modes at once (sliding layers bf16, globals
``int8_per_token_head``, layer 0 ``fp8``), each layer planned, written and read by its own mode."""

from __future__ import annotations

import pytest
import torch

from tests.support.passes import (
    AttnQuantModel,
    RecordingKernel,
    capture_graph,
    check_compiled_equals_eager,
    make_batch,
    make_specs,
    no_compile_caches,
    pages_for,
    qkv,
    run_passes,
)
from torch_kvq.attention import ReferenceKernel
from torch_kvq.models import build_model, generate
from torch_kvq.passes import make_kvq_backend
from torch_kvq.spec import KVCacheConfig
from torch_kvq.spec_modes import FP8_DTYPE

PASSES = ("annotate", "fuse_quant_cache_write", "fuse_dequant_attention", "cleanup")
MODES = ("int8_per_token_head", "fp8_per_token_head")
PLAN = [(0, 5), (3, 1), (0, 2)]


def small(mode: str, form: str):
    specs = make_specs(2, mode, skip=(1,))
    n = pages_for(PLAN)
    model = AttnQuantModel(specs, n, quant_form=form)
    return specs, model, make_batch(PLAN, n), qkv(8, (8, 2), 32, torch.bfloat16)


@pytest.mark.parametrize("form", ["op", "torch"])
@pytest.mark.parametrize("mode", MODES)
def test_write_and_attention_fuse_per_layer(mode: str, form: str) -> None:
    specs, model, md, inputs = small(mode, form)
    gm = capture_graph(model, inputs, md)
    rep = run_passes(gm, specs, PASSES).last
    pth, skipped = specs[0].name, specs[1].name
    assert rep.fused(pth) == ("quant+write", "dequant+attn")
    assert rep.fused(skipped) == ()
    assert rep.ops_after.get("kvq.quant_cache_write_per_token_head") == 1
    assert rep.ops_after.get("kvq.paged_attention_per_token_head") == 1
    for gone in ("kvq.quantize_per_token_head", "kvq.cache_write_per_token_head",
                 "kvq.dequantize_kv_cache_per_token_head"):  # fmt: skip
        assert gone not in rep.ops_after
    assert rep.ops_after["kvq.cache_write"] == rep.ops_after["kvq.paged_attention"] == 1
    left = {str(n.target) for n in gm.graph.nodes}
    assert not any(op in t for t in left for op in ("amax", "round", "abs", "squeeze"))
    write = next(n for n in gm.graph.nodes if "quant_cache_write_per_token_head" in str(n.args))
    want = "half_even" if (form == "torch" and mode.startswith("int8")) else "half_away"
    assert write.kwargs["rounding"] == want


@pytest.mark.parametrize("form", ["op", "torch"])
@pytest.mark.parametrize("mode", MODES)
def test_compiled_equals_eager_bit_for_bit(mode: str, form: str) -> None:
    """Fused write == unfused write (codes and scales), fused attention == unfused attention."""
    specs, model, md, inputs = small(mode, form)
    check_compiled_equals_eager(specs, model, md, inputs)


def test_a_write_of_another_format_is_not_fused() -> None:
    """int8 codes written into an fp8_per_token_head layer: the pass says why, and leaves it."""
    specs, model, md, inputs = small("fp8_per_token_head", "op")
    gm = capture_graph(model, inputs, md)
    for node in gm.graph.nodes:
        if "quantize_per_token_head" in str(node.target):
            node.args = (node.args[0], "int8")
    rep = run_passes(gm, specs, PASSES).last
    assert rep.per_layer[specs[0].name]["fuse_quant_cache_write"] == (
        "not fused: k is quantized to int8, and the layer's mode fp8_per_token_head stores fp8"
    )


def test_annotate_refuses_an_op_of_another_mode() -> None:
    specs, model, md, inputs = small("int8_per_token_head", "op")
    gm = capture_graph(model, inputs, md)
    for node in gm.graph.nodes:
        if node.target is torch.ops.kvq.dequantize_kv_cache_per_token_head.default:
            cache, _, layer, dtype = node.args
            node.target = torch.ops.kvq.dequantize_kv_cache.default
            node.args = (cache, 1.0, 1.0, dtype, layer)
    with pytest.raises(ValueError, match=r"has mode int8_per_token_head but graph node "
                       r"'dequantize_kv_cache_per_token_head' runs kvq.dequantize_kv_cache on it, "
                       r"an op of the fp8 per-tensor mode"):  # fmt: skip
        run_passes(gm, specs, PASSES)


# -- the seed bug, generalized -------------------------------------------------------------------

PROMPTS = [[1, 5, 9, 14, 3, 7, 2, 11, 30, 4, 6], [8, 2, 4], [19, 3, 3, 27, 40, 41]]
# gemma3-tiny: layers 0, 1, 3, 4 sliding, 2 and 5 global. Rules select disjoint layers.
THREE_MODES = KVCacheConfig(
    "auto",
    layer_modes=(("full_attention", "int8_per_token_head"), (0, "fp8")),
    kv_scales=((0, (0.05, 0.05)),),
)


@pytest.mark.parametrize(
    "inner, tol", [("eager", 0.0), pytest.param("inductor", 0.04, marks=pytest.mark.slow)]
)
def test_three_modes_at_once(inner: str, tol: float) -> None:
    """With the eager inner compiler the logits are bit-identical (one semantics: code * scale
    in fp32 fused and unfused); Inductor changes the rest of the model's numerics (as in
    test_mixed_model.py), hence its tolerance."""
    kernel = RecordingKernel(ReferenceKernel())
    model = build_model("gemma3-tiny", THREE_MODES, kernel=kernel, num_pages=16)
    specs = model.kv_specs
    by_mode = {m: {s.name for s in specs if s.mode.value == m}
               for m in ("none", "fp8_per_tensor", "int8_per_token_head")}  # fmt: skip
    assert [s.mode.value for s in specs] == [
        "fp8_per_tensor", "none", "int8_per_token_head", "none", "none", "int8_per_token_head"
    ]  # fmt: skip
    for a in model.attention_layers:  # each layer's cache is its own mode's
        assert a.kv_cache.dtype == a.spec.storage_dtype
        assert (a.kv_scale is not None) == a.spec.mode.per_token_head

    eager = generate(model, PROMPTS, 4, prefill_logits=True)
    eager_attended = {k: set(v) for k, v in kernel.attended.items()}
    kernel.attended.clear()
    kernel.planned.clear()

    backend = make_kvq_backend(inner=inner)
    with no_compile_caches():
        compiled = generate(
            model, PROMPTS, 4, forward=torch.compile(model, backend=backend),
            force_tokens=eager.tokens, prefill_logits=True,
        )  # fmt: skip

    bf16, f32 = torch.bfloat16, torch.float32
    for name in by_mode["none"]:  # planned, written and read in bf16, never fused
        assert kernel.planned[name] == {(bf16, bf16)}
        assert kernel.attended[name] == eager_attended[name] == {(bf16, bf16, False, False)}
    for name in by_mode["fp8_per_tensor"]:
        assert kernel.planned[name] == {(bf16, FP8_DTYPE)}
        assert kernel.attended[name] == {(bf16, FP8_DTYPE, False, False)}
        assert eager_attended[name] == {(bf16, f32, False, False)}
    for name in by_mode["int8_per_token_head"]:  # codes and scales read in place
        assert kernel.planned[name] == {(bf16, torch.int8)}
        assert kernel.attended[name] == {(bf16, torch.int8, False, True)}
        assert eager_attended[name] == {(bf16, f32, False, False)}
    for manager in backend.managers:
        rep = manager.last
        quantized = by_mode["fp8_per_tensor"] | by_mode["int8_per_token_head"]
        assert set(rep.layers_fused("quant+write")) == quantized
        assert set(rep.layers_fused("dequant+attn")) == quantized
        for name in by_mode["none"]:
            assert rep.fused(name) == ()
        assert rep.ops_after["kvq.quant_cache_write_per_token_head"] == 2
        assert rep.ops_after["kvq.paged_attention_per_token_head"] == 2
        assert (
            rep.ops_after["kvq.quant_cache_write"] == rep.ops_after["kvq.paged_attention_fp8"] == 1
        )
        assert rep.ops_after["kvq.cache_write"] == rep.ops_after["kvq.paged_attention"] == 3

    assert compiled.tokens == eager.tokens
    for a in model.attention_layers:  # written by their own mode (the pages differ by run)
        assert a.kv_cache.view(torch.uint8).any()
        assert a.kv_scale is None or a.kv_scale.any()
    for c, e in zip(compiled.prefill_logits, eager.prefill_logits):
        torch.testing.assert_close(c, e, rtol=0, atol=tol * e.abs().max().item())
    torch.testing.assert_close(
        compiled.logits, eager.logits, rtol=0, atol=tol * eager.logits.abs().max().item()
    )
