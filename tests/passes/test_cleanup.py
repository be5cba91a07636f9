"""cleanup: dead pure nodes go, mutations stay, topological order is restored."""

from __future__ import annotations

import pytest
import torch

from tests.support.passes import capture_graph, run_passes, small_case
from torch_kvq.passes import CleanupPass, PassContext


def test_dead_nodes_removed_order_restored_copies_kept():
    model, md, inputs = small_case("op")
    gm = capture_graph(model, inputs, md)
    graph = gm.graph
    first = next(iter(graph.nodes))
    copies = [n for n in graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert len(copies) == 3  # one write-back per cache buffer
    out_val = graph.output_node().args[0][0]
    with graph.inserting_before(first):  # uses a node defined later: out of order
        early = graph.call_function(torch.ops.aten.neg.default, (out_val,))
    graph.output_node().args = ((*graph.output_node().args[0], early),)
    with graph.inserting_after(out_val):
        graph.call_function(torch.ops.aten.abs.default, (out_val,))  # dead
    with pytest.raises(RuntimeError):
        graph.lint()
    removed = CleanupPass()(graph, PassContext(stamps={}))
    assert removed == 1
    graph.lint()
    order = list(graph.nodes)
    assert order.index(early) > order.index(out_val)
    assert [n for n in graph.nodes if n.target is torch.ops.aten.copy_.default] == copies
    assert not [n for n in graph.nodes if n.target is torch.ops.aten.abs.default]


def test_cleanup_after_fusions_leaves_no_dead_code():
    model, md, inputs = small_case("torch")
    gm = capture_graph(model, inputs, md)
    manager = run_passes(
        gm,
        model.specs,
        [
            "annotate",
            "fuse_quant_cache_write",
            "fuse_dequant_attention",
            "fuse_attention_output_quant",
            "cleanup",
        ],
    )
    n = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    assert len(gm.graph.nodes) == n
    assert manager.last.per_pass["cleanup"].matches == 0  # fusions erase what they replace
