"""fuse_quant_cache_write: k/v static FP8 quant + cache write -> kvq.quant_cache_write."""

from __future__ import annotations

import pytest
import torch

from tests.support.passes import (
    capture_graph,
    clamp240_quant,
    manual_case,
    model_dtype_quant,
    mul_quant,
    nodes_of,
    run_passes,
    small_case,
    torch_quant,
)
from torch_kvq.attention.kernels.capabilities import register_capabilities
from torch_kvq.passes.graph_utils import CACHE_WRITE, QUANT_CACHE_WRITE, QUANTIZE
from torch_kvq.passes.stamp import get_stamp
from torch_kvq.spec_modes import KVQuantMode

PASSES = ["annotate", "fuse_quant_cache_write", "cleanup"]


@pytest.mark.parametrize("quant_form", ["op", "torch"])
def test_quantized_layers_fused_skipped_layer_untouched(quant_form):
    model, md, inputs = small_case(quant_form)
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, PASSES)
    k, v = (
        n for n in gm.graph.find_nodes(op="placeholder") if n.meta["val"].shape == inputs[1].shape
    )
    fused = nodes_of(gm, QUANT_CACHE_WRITE)
    assert sorted(n.kwargs["layer_name"] for n in fused) == [
        model.specs[0].name,
        model.specs[2].name,
    ]
    for node in fused:
        spec = get_stamp(node).spec
        assert (node.kwargs["k"], node.kwargs["v"]) == (k, v)  # the model-dtype inputs
        assert (node.kwargs["k_scale"], node.kwargs["v_scale"]) == (spec.k_scale, spec.v_scale)
        assert get_stamp(node).fused == ("fused quant+write",)
        assert "val" not in node.meta  # Inductor's FakeTensorUpdater fills it, we never write it
    (kept,) = nodes_of(gm, CACHE_WRITE)
    assert kept.kwargs["layer_name"] == model.specs[1].name
    assert (kept.kwargs["k"], kept.kwargs["v"]) == (k, v)  # bf16 k / v straight into the bf16 cache
    writes_k = {n.kwargs["k"] for n in fused}
    assert not any(n in writes_k for n in nodes_of(gm, QUANTIZE))
    decisions = manager.last.per_pass["fuse_quant_cache_write"].decisions
    assert decisions == {
        model.specs[0].name: "fused quant+write",
        model.specs[1].name: "kept bf16 (skipped: skip rule 1)",
        model.specs[2].name: "fused quant+write",
    }
    assert manager.last.per_pass["fuse_quant_cache_write"].matches == 2


@pytest.mark.parametrize("kv_quant", [torch_quant, mul_quant], ids=["div", "mul"])
def test_torch_native_div_and_mul_forms(kv_quant):
    model, md, inputs = manual_case(kv_quant=kv_quant)
    gm = capture_graph(model, inputs, md)
    run_passes(gm, model.specs, PASSES)
    (fused,) = nodes_of(gm, QUANT_CACHE_WRITE)
    spec = model.specs[0]
    assert fused.kwargs["k_scale"] == pytest.approx(spec.k_scale, rel=1e-12)
    assert fused.kwargs["v_scale"] == pytest.approx(spec.v_scale, rel=1e-12)
    assert fused.kwargs["k"].op == "placeholder"
    assert not nodes_of(gm, CACHE_WRITE)


def test_quant_computed_in_the_model_dtype_is_not_fused():
    """``(k / s)`` on a bf16 k rounds the quotient to bf16 before the FP8 cast: the fused fp32
    write would store other bytes for some values, so it stays unfused with that reason."""
    model, md, inputs = manual_case(kv_quant=model_dtype_quant)
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, PASSES)
    assert not nodes_of(gm, QUANT_CACHE_WRITE)
    decision = manager.last.per_layer[model.specs[0].name]["fuse_quant_cache_write"]
    assert "it scales in torch.bfloat16" in decision, decision


def test_other_clamp_bounds_are_not_fused():
    model, md, inputs = manual_case(kv_quant=clamp240_quant)
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, PASSES)
    assert not nodes_of(gm, QUANT_CACHE_WRITE)
    assert len(nodes_of(gm, CACHE_WRITE)) == 1
    decision = manager.last.per_layer[model.specs[0].name]["fuse_quant_cache_write"]
    assert decision.startswith("not fused: k is not a static FP8 quant")


def test_kernel_that_cannot_read_fp8_is_not_fused():
    register_capabilities("test-bf16-only", "cpu", [(KVQuantMode.NONE, torch.bfloat16, False)])
    model, md, inputs = small_case("op")
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, PASSES, kernel="test-bf16-only")
    assert not nodes_of(gm, QUANT_CACHE_WRITE)
    assert len(nodes_of(gm, CACHE_WRITE)) == 3
    decision = manager.last.per_layer[model.specs[0].name]["fuse_quant_cache_write"]
    assert (
        decision
        == "not fused: kernel 'test-bf16-only' on cpu does not read fp8_per_tensor caches with bf16 q"
    )
