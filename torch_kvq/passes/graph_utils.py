"""Reading FX graphs: the kvq op targets, node helpers, and the small erase helpers passes share.

Everything here only *reads* a graph, except ``erase_dead``; each pass module does its own
rewrite.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import fx

from torch_kvq.attention import ops as _ops  # noqa: F401  (registers torch.ops.kvq.*)
from torch_kvq.attention import ops_per_token_head as _ops_pth  # noqa: F401  (likewise)
from torch_kvq.attention import ops_tc as _ops_tc  # noqa: F401  (likewise)
from torch_kvq.spec_modes import FP8_DTYPE

KVQ = torch.ops.kvq
QUANTIZE = KVQ.quantize_fp8.default
DEQUANTIZE = KVQ.dequantize_kv_cache.default
CACHE_WRITE = KVQ.cache_write.default
QUANT_CACHE_WRITE = KVQ.quant_cache_write.default
QUANT_CACHE_WRITE_TS = KVQ.quant_cache_write_ts.default
ATTENTION = KVQ.paged_attention.default
ATTENTION_FP8 = KVQ.paged_attention_fp8.default
# the per-(token, head) modes' ops (attention/ops_per_token_head.py)
QUANTIZE_PTH = KVQ.quantize_per_token_head.default
CACHE_WRITE_PTH = KVQ.cache_write_per_token_head.default
DEQUANTIZE_PTH = KVQ.dequantize_kv_cache_per_token_head.default
QUANT_CACHE_WRITE_PTH = KVQ.quant_cache_write_per_token_head.default
ATTENTION_PTH = KVQ.paged_attention_per_token_head.default
# the transform-coded mode's ops (attention/ops_tc.py)
QUANTIZE_TC = KVQ.quantize_tc.default
CACHE_WRITE_TC = KVQ.cache_write_tc.default
DEQUANTIZE_TC = KVQ.dequantize_kv_cache_tc.default
QUANT_CACHE_WRITE_TC = KVQ.quant_cache_write_tc.default
ATTENTION_TC = KVQ.paged_attention_tc.default
AUTO_FUNCTIONALIZED = (
    torch.ops.higher_order.auto_functionalized,
    torch.ops.higher_order.auto_functionalized_v2,
)
# dtypes a float cast in a graph may produce (cast matching); not the model dtypes (spec.MODEL_DTYPES)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
VIEW_OPS = (
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
)
CONVERT = torch.ops.prims.convert_element_type.default
TO_COPY = torch.ops.aten._to_copy.default


def is_call(node: object, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def functional_op(node: fx.Node) -> Any:
    """The custom op a node runs: its target, or the op wrapped by ``auto_functionalized[_v2]``."""
    if is_call(node, *AUTO_FUNCTIONALIZED):
        return node.args[0]
    return node.target if node.op == "call_function" else None


def op_args(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name (also for ``auto_functionalized[_v2]`` nodes)."""
    op = functional_op(node)
    if is_call(node, *AUTO_FUNCTIONALIZED):
        return dict(node.kwargs)
    names = [a.name for a in op._schema.arguments]
    out = dict(zip(names, node.args))
    out.update(node.kwargs)
    return out


def layer_name_of(node: fx.Node) -> str | None:
    """The ``layer_name`` argument of a kvq op node (or of the op it wraps), else None."""
    op = functional_op(node)
    if getattr(op, "namespace", None) != "kvq":
        return None
    name = op_args(node).get("layer_name")
    return name if isinstance(name, str) else None


def kvq_nodes(graph: fx.Graph) -> Iterator[fx.Node]:
    for node in graph.nodes:
        if getattr(functional_op(node), "namespace", None) == "kvq":
            yield node


def node_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype recorded by PyTorch in ``meta["val"]`` (read only), else None."""
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def op_label(node: fx.Node) -> str:
    """A short readable name for reports: ``kvq.cache_write``, ``aten.div``, ..."""
    op = functional_op(node)
    if op is None:
        return node.op
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}.{op._opname}"
    return getattr(op, "__name__", str(op))


def float_cast_arg(node: object) -> fx.Node | None:
    """If ``node`` only casts between float dtypes, the node it casts, else None."""
    if is_call(node, CONVERT) and node.args[1] in FLOAT_DTYPES:
        src = node.args[0]
        return src if isinstance(src, fx.Node) else None
    if is_call(node, TO_COPY) and set(node.kwargs) <= {"dtype"}:
        if node.kwargs.get("dtype") in FLOAT_DTYPES and isinstance(node.args[0], fx.Node):
            return node.args[0]
    return None


def skip_float_casts(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """Walk back through float casts: (first non-cast node, casts passed, last first)."""
    casts = []
    while (src := float_cast_arg(node)) is not None:
        casts.append(node)
        node = src
    return node, casts


def is_fp8_cast(node: object) -> bool:
    if is_call(node, CONVERT):
        return node.args[1] == FP8_DTYPE
    if is_call(node, TO_COPY):
        return node.kwargs.get("dtype") == FP8_DTYPE and set(node.kwargs) <= {"dtype"}
    return False


def is_fp8_quant_end(node: object) -> bool:
    """True for a node producing FP8: a ``kvq.quantize_fp8`` or a cast to float8_e4m3fn."""
    return is_call(node, QUANTIZE) or is_fp8_cast(node)


def single_user_chain(nodes: list[fx.Node] | tuple[fx.Node, ...]) -> fx.Node | None:
    """The first node of ``nodes`` (all but the last) with more than one user, else None."""
    for n in nodes[:-1]:
        if len(n.users) != 1:
            return n
    return None


def erase_dead(graph: fx.Graph, nodes: list[fx.Node] | tuple[fx.Node, ...]) -> None:
    """Erase the given nodes that have no users, last first (pure nodes only)."""
    for n in reversed(list(nodes)):
        if not getattr(n, "_erased", False) and not n.users and not n.is_impure():
            graph.erase_node(n)


def has_output_scale(node: fx.Node) -> bool:
    """True if a ``paged_attention_fp8`` node writes FP8 output (a float or a tensor scale)."""
    args = op_args(node)
    return args.get("output_scale") is not None or args.get("output_scale_tensor") is not None


def count_ops(graph: fx.Graph) -> dict[str, int]:
    """kvq op counts (auto_functionalized writes counted as their op), plus ``fp8_cast`` (torch-native
    FP8 casts) and ``output_scale`` (fused attentions that write FP8 output)."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        key = None
        op = functional_op(node)
        if getattr(op, "namespace", None) == "kvq":
            key = op_label(node)
            if op is ATTENTION_FP8 and has_output_scale(node):
                counts["output_scale"] = counts.get("output_scale", 0) + 1
        elif is_fp8_cast(node):
            key = "fp8_cast"
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))
