"""cleanup: a stable topological order, dead code elimination, then a lint of the graph.

Fusions leave the replaced quant / dequant nodes dead and may insert nodes after their users'
inputs; this pass removes the dead pure nodes and restores a valid order (mutating nodes such
as the trailing ``aten.copy_`` into the cache buffer are kept)::

    before:  quantize_fp8 = kvq.quantize_fp8(k, 0.5)        # no users left
             auto_functionalized_v2 = auto_functionalized_v2(kvq.quant_cache_write, k=k, ...)
    after:   auto_functionalized_v2 = auto_functionalized_v2(kvq.quant_cache_write, k=k, ...)
"""

from __future__ import annotations

from typing import ClassVar

from torch import fx
from torch._inductor.pattern_matcher import stable_topological_sort

from torch_kvq.passes.base import KVQPass, PassContext


class CleanupPass(KVQPass):
    """Remove dead nodes, restore topological order, lint (see module doc)."""

    name: ClassVar[str] = "cleanup"

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        stable_topological_sort(graph)
        removed = _eliminate_dead_code(graph)
        graph.lint()
        return removed


def _eliminate_dead_code(graph: fx.Graph) -> int:
    """``Graph.eliminate_dead_code`` asks ``is_impure()`` of every node (slow for custom ops);
    only nodes without users can be dead, so ask only those."""
    removed = 0
    for node in reversed(graph.nodes):
        if node.op in ("placeholder", "output") or node.users or node.is_impure():
            continue
        graph.erase_node(node)
        removed += 1
    return removed
