"""annotate: every kvq op node carries its own layer's stamp; unknown or changed layers fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.passes import capture_graph, make_specs, run_passes, small_case, torch_quant
from torch_kvq.attention import Attention, PageAllocator, ReferenceKernel, forward_context, registry
from torch_kvq.passes import KVQStamp, make_kvq_backend
from torch_kvq.passes.graph_utils import (
    ATTENTION,
    AUTO_FUNCTIONALIZED,
    CACHE_WRITE,
    DEQUANTIZE,
    QUANTIZE,
    functional_op,
    kvq_nodes,
)
from torch_kvq.passes.stamp import get_stamp
from torch_kvq.spec_modes import KVQuantMode


def test_every_kvq_node_gets_its_layers_stamp():
    model, md, inputs = small_case("op")
    gm = capture_graph(model, inputs, md)
    code_before = gm.code
    manager = run_passes(gm, model.specs, ["annotate"])
    assert gm.code == code_before  # annotate does not change the graph
    by_name = {s.name: s for s in model.specs}
    nodes = list(kvq_nodes(gm.graph))
    # 3 writes + 3 attentions + 2 dequant + 2x2 k/v quants + 3 output quants
    assert len(nodes) == 15
    for node in nodes:
        stamp = get_stamp(node)
        assert isinstance(stamp, KVQStamp), node.format_node()
        assert stamp.spec == by_name[stamp.layer]
        assert stamp.kernel == "reference" and stamp.arch == "cpu"
    for node in nodes:
        op, stamp = functional_op(node), get_stamp(node)
        if op is QUANTIZE and any(functional_op(u) is CACHE_WRITE for u in node.users):
            (user,) = node.users
            assert get_stamp(user).layer == stamp.layer  # k / v quant -> its write's layer
        if op is DEQUANTIZE:
            (user,) = node.users
            assert functional_op(user) is ATTENTION and get_stamp(user).layer == stamp.layer
        if op is CACHE_WRITE:
            assert node.target in AUTO_FUNCTIONALIZED
            assert node.kwargs["layer_name"] == stamp.layer
    skipped = by_name[model.specs[1].name]
    assert skipped.mode is KVQuantMode.NONE
    stamps_of_skipped = [get_stamp(n) for n in nodes if get_stamp(n).layer == skipped.name]
    assert stamps_of_skipped and all(
        not s.kv_in_place and not s.fp8_output for s in stamps_of_skipped
    )
    assert stamps_of_skipped[0].kept_reason() == "kept bf16 (skipped: skip rule 1)"
    decisions = manager.last.per_pass["annotate"].decisions
    assert set(decisions) == set(by_name)


def test_torch_form_stamps_only_kvq_ops():
    model, md, inputs = small_case("torch")
    gm = capture_graph(model, inputs, md)
    run_passes(gm, model.specs, ["annotate"])
    stamped = [n for n in gm.graph.nodes if get_stamp(n) is not None]
    assert {functional_op(n) for n in stamped} == {CACHE_WRITE, DEQUANTIZE, ATTENTION}
    assert len(stamped) == 3 + 2 + 3


def test_unknown_layer_is_an_error():
    model, md, inputs = small_case("op")
    gm = capture_graph(model, inputs, md)
    gone = model.layers[2]
    registry.unregister(gone)
    try:
        with pytest.raises(
            ValueError, match=rf"names attention layer '{gone.layer_name}'.*unknown attention layer"
        ):
            run_passes(gm, model.specs, ["annotate"])
    finally:
        registry.register(gone)


def test_layer_missing_from_the_managers_table_is_an_error():
    model, md, inputs = small_case("op")
    gm = capture_graph(model, inputs, md)
    with pytest.raises(ValueError, match=r"not in the pass manager's spec table"):
        run_passes(gm, model.specs[:2], ["annotate"])


def test_layer_whose_spec_changed_is_an_error():
    model, md, inputs = small_case("op")
    gm = capture_graph(model, inputs, md)
    stale = list(model.specs)
    stale[0] = dataclasses.replace(stale[0], k_scale=0.5)
    with pytest.raises(
        ValueError, match=rf"layer '{stale[0].name}' changed since its pass manager was built"
    ):
        run_passes(gm, stale, ["annotate"])


def test_auto_layers_are_kept_with_their_reason():
    (spec,) = make_specs(1, "auto")
    from torch_kvq.passes import make_stamp

    stamp = make_stamp(spec, "reference", "cpu")
    assert stamp.kept_reason() == "kept bf16 (not quantized: mode none)"
    assert stamp.kv_block() == stamp.output_block() == stamp.kept_reason()


class QuantIntoSkippedCache(torch.nn.Module):
    """The seed bug written by hand: FP8 k / v into a skipped layer's bf16 cache."""

    def __init__(self, spec, num_pages: int, form: str) -> None:
        super().__init__()
        self.attn = Attention(spec, num_pages)
        self.form = form

    def forward(self, q, k, v):
        s = self.attn.spec
        quant = torch_quant if self.form == "torch" else torch.ops.kvq.quantize_fp8
        torch.ops.kvq.cache_write(quant(k, 0.1), quant(v, 0.1), self.attn.kv_cache, s.name)
        return torch.ops.kvq.paged_attention(q, self.attn.kv_cache, s.name)


@pytest.mark.parametrize("form", ["op", "torch"])
def test_fp8_written_into_a_skipped_layers_cache_is_refused(form):
    (spec,) = make_specs(1, "fp8", skip=(0,))
    model = QuantIntoSkippedCache(spec, 8, form)
    md = PageAllocator(8, 16).build_batch([(0, 7)])
    x = (
        torch.randn(7, 8, 32).bfloat16(),
        torch.randn(7, 2, 32).bfloat16(),
        torch.randn(7, 2, 32).bfloat16(),
    )
    backend = make_kvq_backend(inner="eager")
    with torch.no_grad(), forward_context(md, [spec], ReferenceKernel()):
        with pytest.raises(
            Exception,
            match=rf"layer '{spec.name}' is kept in bf16 \(skip rule 0\) but graph node "
            r"'auto_functionalized_v2' writes FP8 into its cache: k has dtype "
            r"torch.float8_e4m3fn, expected torch.bfloat16",
        ):
            torch.compile(model, backend=backend, fullgraph=True)(*x)
    assert not backend.graphs  # refused at compile time, before anything ran
