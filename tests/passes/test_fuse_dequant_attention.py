"""fuse_dequant_attention: whole-cache dequant + attention -> attention on the FP8 cache in place."""

from __future__ import annotations

import operator

import torch

from tests.support.passes import capture_graph, manual_case, nodes_of, run_passes, small_case
from torch_kvq.attention.kernels.capabilities import register_capabilities
from torch_kvq.passes.graph_utils import (
    ATTENTION,
    ATTENTION_FP8,
    DEQUANTIZE,
    QUANT_CACHE_WRITE,
    op_args,
)
from torch_kvq.passes.stamp import get_stamp
from torch_kvq.spec_modes import FP8_DTYPE, KVQuantMode

PASSES = ["annotate", "fuse_quant_cache_write", "fuse_dequant_attention", "cleanup"]


def test_quantized_layers_read_the_fp8_cache_in_place():
    model, md, inputs = small_case("op")
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, PASSES)
    assert not nodes_of(gm, DEQUANTIZE)  # no model-dtype copy of any cache is left
    fused = nodes_of(gm, ATTENTION_FP8)
    writes = {n.kwargs["layer_name"]: n for n in nodes_of(gm, QUANT_CACHE_WRITE)}
    assert len(fused) == 2
    for node in fused:
        args = op_args(node)
        spec = get_stamp(node).spec
        assert args["layer_name"] == spec.name and spec.is_quantized
        assert (args["k_scale"], args["v_scale"]) == (spec.k_scale, spec.v_scale)
        assert args.get("output_scale") is None
        cache = args["kv_cache"]  # the functional value of this layer's (fused) write
        assert cache.target is operator.getitem and cache.args[0] is writes[spec.name]
        assert cache.meta["val"].dtype == FP8_DTYPE
        assert get_stamp(node).fused == ("fused dequant+attn",)
    (kept,) = nodes_of(gm, ATTENTION)
    assert op_args(kept)["layer_name"] == model.specs[1].name
    assert op_args(kept)["kv_cache"].meta["val"].dtype == torch.bfloat16
    decisions = manager.last.per_pass["fuse_dequant_attention"].decisions
    assert list(decisions.values()).count("fused dequant+attn") == 2
    assert decisions[model.specs[1].name] == "kept bf16 (skipped: skip rule 1)"


def test_attention_counts_unchanged():
    model, md, inputs = small_case("torch")
    gm = capture_graph(model, inputs, md)
    before = len(nodes_of(gm, ATTENTION))
    run_passes(gm, model.specs, PASSES)
    assert len(nodes_of(gm, ATTENTION)) + len(nodes_of(gm, ATTENTION_FP8)) == before == 3


def test_attention_not_fed_by_a_dequant_is_not_fused():
    model, md, inputs = manual_case(attend_dtype=torch.bfloat16)  # dequant to fp32, cast to bf16
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, PASSES)
    assert not nodes_of(gm, ATTENTION_FP8) and len(nodes_of(gm, ATTENTION)) == 1
    decision = manager.last.per_layer[model.specs[0].name]["fuse_dequant_attention"]
    assert (
        decision
        == "not fused: the attention's cache is not kvq.dequantize_kv_cache (found prims.convert_element_type)"
    )


def test_dequant_to_the_model_dtype_is_not_fused():
    # the fused attention reads code * scale in fp32; a bf16 dequant rounds first: not the same
    model, md, inputs = manual_case(dequant_dtype=torch.bfloat16)
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, PASSES)
    assert not nodes_of(gm, ATTENTION_FP8) and len(nodes_of(gm, DEQUANTIZE)) == 1
    decision = manager.last.per_layer[model.specs[0].name]["fuse_dequant_attention"]
    assert decision.startswith("not fused: the cache is dequantized to torch.bfloat16")


def test_kernel_that_cannot_read_fp8_keeps_the_dequant():
    register_capabilities("test-bf16-only", "cpu", [(KVQuantMode.NONE, torch.bfloat16, False)])
    model, md, inputs = small_case("op")
    gm = capture_graph(model, inputs, md)
    run_passes(gm, model.specs, PASSES, kernel="test-bf16-only")
    assert len(nodes_of(gm, DEQUANTIZE)) == 2 and not nodes_of(gm, ATTENTION_FP8)
