"""fuse_attention_output_quant: FP8 attention + static FP8 output quant -> output_scale."""

from __future__ import annotations

import pytest
import torch

from tests.support.passes import (
    OUT_SCALE,
    capture_graph,
    manual_case,
    nodes_of,
    run_passes,
    small_case,
)
from torch_kvq.attention.kernels.capabilities import register_capabilities
from torch_kvq.passes import DEFAULT_PASSES
from torch_kvq.passes.graph_utils import (
    ATTENTION,
    ATTENTION_FP8,
    QUANTIZE,
    VIEW_OPS,
    count_ops,
    op_args,
)
from torch_kvq.passes.stamp import get_stamp
from torch_kvq.spec_modes import KVQuantMode


def scaled(gm):
    return [n for n in nodes_of(gm, ATTENTION_FP8) if op_args(n).get("output_scale") is not None]


@pytest.mark.parametrize("form", ["op", "torch", "mul"])
def test_output_quant_fused_through_the_reshape(form):
    model, md, inputs = manual_case(out_form=form)
    gm = capture_graph(model, inputs, md)
    before = count_ops(gm.graph)
    manager = run_passes(gm, model.specs, DEFAULT_PASSES)
    (node,) = scaled(gm)
    assert op_args(node)["output_scale"] == pytest.approx(OUT_SCALE, rel=1e-12)
    assert get_stamp(node).fused == ("fused dequant+attn", "fused output quant")
    (user,) = node.users  # the reshape to [T, QH * D], now on the FP8 output
    assert user.target in VIEW_OPS
    (out,) = gm.graph.output_node().args[0]
    assert out is user
    after = count_ops(gm.graph)
    quants = ("kvq.quantize_fp8", "fp8_cast")
    assert sum(before.get(q, 0) for q in quants) == 3  # k, v (kvq op) and the output quant
    assert sum(after.get(q, 0) for q in quants) == 0
    assert manager.last.fused(model.specs[0].name) == (
        "quant+write",
        "dequant+attn",
        "output quant",
    )


def test_skipped_layer_output_quant_never_fused():
    model, md, inputs = small_case("op")
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, DEFAULT_PASSES)
    assert sorted(op_args(n)["layer_name"] for n in scaled(gm)) == [
        model.specs[0].name,
        model.specs[2].name,
    ]
    (kept,) = nodes_of(gm, ATTENTION)
    (view,) = kept.users
    (quant,) = view.users
    assert quant.target is QUANTIZE  # the skipped layer's bf16 output is quantized as written
    rep = manager.last
    assert (
        rep.per_layer[model.specs[1].name]["fuse_attention_output_quant"]
        == "kept bf16 (skipped: skip rule 1)"
    )
    assert rep.layers_fused("output quant") == (model.specs[0].name, model.specs[2].name)


def test_output_with_another_user_is_not_fused():
    model, md, inputs = manual_case(out_form="torch", also_return_output=True)
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, DEFAULT_PASSES)
    assert not scaled(gm) and len(nodes_of(gm, ATTENTION_FP8)) == 1
    decision = manager.last.per_layer[model.specs[0].name]["fuse_attention_output_quant"]
    assert decision.startswith("not fused: paged_attention_fp8") and decision.endswith(
        "has 2 users"
    )


def test_no_output_quant_is_reported():
    model, md, inputs = manual_case(out_form=None)
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, DEFAULT_PASSES)
    decision = manager.last.per_layer[model.specs[0].name]["fuse_attention_output_quant"]
    assert decision == "not fused: no static FP8 quant of the attention output"


def test_kernel_without_fp8_output_keeps_the_quant():
    base = [
        (KVQuantMode.NONE, torch.bfloat16, False),
        (KVQuantMode.FP8_PER_TENSOR, torch.bfloat16, False),
    ]
    register_capabilities("test-no-fp8-out", "cpu", base)
    model, md, inputs = small_case("torch")
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, DEFAULT_PASSES, kernel="test-no-fp8-out")
    assert not scaled(gm) and len(nodes_of(gm, ATTENTION_FP8)) == 2
    assert count_ops(gm.graph)["fp8_cast"] == 3  # the three output quants stay
    decision = manager.last.per_layer[model.specs[0].name]["fuse_attention_output_quant"]
    assert (
        decision
        == "not fused: kernel 'test-no-fp8-out' on cpu does not write FP8 output for fp8_per_tensor with bf16 q"
    )
    assert manager.last.fused(model.specs[0].name) == ("quant+write", "dequant+attn")
