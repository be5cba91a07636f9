"""annotate: stamp ``node.meta["kvq"]`` on every kvq op node with its layer's ``KVQStamp``.

The layer comes from the node's ``layer_name`` argument, resolved through the live-layer
registry; an unknown layer, or one whose live spec differs from the pass manager's spec table,
is an error. Ops without a layer argument take the stamp of the layer op they feed
(``quantize_fp8`` -> cache write, ``dequantize_kv_cache`` -> attention) or, for an output quant,
of the attention they quantize. The graph itself is not changed::

    before:  paged_attention = kvq.paged_attention(q, dequantize_kv_cache, 'l0')
    after:   same node, meta["kvq"] = KVQStamp(spec=<l0 spec>, kernel='reference', arch='cpu', ...)
"""

from __future__ import annotations

from typing import ClassVar

from torch import fx

from torch_kvq.attention import registry
from torch_kvq.passes.common import (
    ATTENTION,
    ATTENTION_FP8,
    META_KEY,
    VIEW_OPS,
    PassContext,
    get_stamp,
    is_call,
    kvq_nodes,
    layer_name_of,
    op_args,
    skip_float_casts,
)


class AnnotatePass:
    """Stamp every kvq op node with its layer's spec and kernel decisions (see module doc)."""

    name: ClassVar[str] = "annotate"

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        stamped = 0
        seen: dict[str, None] = {}
        unnamed: list[fx.Node] = []
        for node in kvq_nodes(graph):
            layer = layer_name_of(node)
            if layer is None:
                unnamed.append(node)
                continue
            node.meta[META_KEY] = self._stamp_for(node, layer, ctx)
            seen[layer] = None
            stamped += 1
        for node in unnamed:
            source = _owner(node)
            if source is not None:
                node.meta[META_KEY] = get_stamp(source)
                stamped += 1
        for layer in seen:
            stamp = ctx.stamps[layer]
            ctx.decide(
                layer, f"stamped: {stamp.spec.mode.value}, kernel {stamp.kernel!r} on {stamp.arch}"
            )
        return stamped

    @staticmethod
    def _stamp_for(node: fx.Node, layer: str, ctx: PassContext) -> object:
        try:
            live = registry.lookup(layer)
        except KeyError as e:
            raise ValueError(
                f"graph node {node.name!r} names attention layer {layer!r}: {e.args[0]}"
            ) from None
        stamp = ctx.stamps.get(layer)
        if stamp is None:
            raise ValueError(
                f"graph node {node.name!r} names attention layer {layer!r}, which is not in the pass "
                f"manager's spec table (it has {sorted(ctx.stamps)[:6]}); build the manager from "
                "this graph's layers (kvq_backend does)"
            )
        if stamp.spec != live:
            raise ValueError(
                f"layer {layer!r} changed since its pass manager was built: the live spec is "
                f"{live.mode.value}/{live.storage_dtype}, the manager's is "
                f"{stamp.spec.mode.value}/{stamp.spec.storage_dtype}; recompile"
            )
        return stamp


def _owner(node: fx.Node) -> fx.Node | None:
    """The stamped layer op a layer-less kvq op belongs to (a user, else the quantized attention)."""
    for user in node.users:
        if layer_name_of(user) is not None and get_stamp(user) is not None:
            return user
    src = op_args(node).get("x")
    while isinstance(src, fx.Node):
        src, _ = skip_float_casts(src)
        if is_call(src, ATTENTION, ATTENTION_FP8):
            return src if get_stamp(src) is not None else None
        if not is_call(src, *VIEW_OPS):
            return None
        src = src.args[0]
    return None
