"""annotate: stamp ``node.meta["kvq"]`` on every kvq op node with its layer's ``KVQStamp``.

The layer comes from the node's ``layer_name`` argument, resolved through the live-layer
registry; an unknown layer, or one whose live spec differs from the pass manager's spec table,
is an error. So is FP8 work on an unquantized (e.g. skipped) layer: FP8 k / v written into its
cache, or a dequantize / FP8 attention / quantizing write on it (the seed bug, at compile time),
and a quantized layer's op of another mode (a per-(token, head) op on an fp8 per-tensor layer,
or the reverse). Ops without a layer argument take the stamp of the layer op they feed
(``quantize_fp8`` -> cache write, ``dequantize_kv_cache`` -> attention) or, for an output quant,
of the attention they quantize. The graph itself is not changed::

    before:  paged_attention = kvq.paged_attention(q, dequantize_kv_cache, 'l0')
    after:   same node, meta["kvq"] = KVQStamp(spec=<l0 spec>, kernel='reference', arch='cpu', ...)
"""

from __future__ import annotations

import operator
from typing import ClassVar

from torch import fx

from torch_kvq.attention import registry
from torch_kvq.passes.base import KVQPass, PassContext
from torch_kvq.passes.graph_utils import (
    ATTENTION,
    ATTENTION_FP8,
    ATTENTION_PTH,
    ATTENTION_TC,
    CACHE_WRITE,
    CACHE_WRITE_PTH,
    CACHE_WRITE_TC,
    DEQUANTIZE,
    DEQUANTIZE_PTH,
    DEQUANTIZE_TC,
    QUANT_CACHE_WRITE,
    QUANT_CACHE_WRITE_PTH,
    QUANT_CACHE_WRITE_TC,
    QUANT_CACHE_WRITE_TS,
    VIEW_OPS,
    functional_op,
    is_call,
    kvq_nodes,
    layer_name_of,
    node_dtype,
    op_args,
    op_label,
    skip_float_casts,
)
from torch_kvq.passes.quant_match import match_static_fp8_quant
from torch_kvq.passes.stamp import META_KEY, KVQStamp, get_stamp, short_dtype
from torch_kvq.spec_modes import FP8_DTYPE


class AnnotatePass(KVQPass):
    """Stamp every kvq op node with its layer's spec and kernel decisions (see module doc)."""

    name: ClassVar[str] = "annotate"
    writes_stamps: ClassVar[bool] = True

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
        for node in kvq_nodes(graph):
            stamp = get_stamp(node)
            if stamp is not None and not stamp.spec.is_quantized:
                _check_unquantized(node, stamp)
            elif stamp is not None:
                _check_mode_ops(node, stamp)
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
            old, new = stamp.spec.as_dict(), live.as_dict()
            changed = ", ".join(f"{k} {old[k]!r} -> {new[k]!r}" for k in old if old[k] != new[k])
            raise ValueError(
                f"layer {layer!r} changed since its pass manager was built ({changed}); recompile"
            )
        return stamp


def _check_unquantized(node: fx.Node, stamp: KVQStamp) -> None:
    """Refuse FP8 work on a layer whose stamp says it is not quantized."""
    spec = stamp.spec
    kept = f"kept in {short_dtype(spec.model_dtype)} ({spec.skip_reason or 'not quantized'})"
    op = functional_op(node)
    if op is CACHE_WRITE:
        for arg_name in ("k", "v"):
            arg = op_args(node).get(arg_name)
            if not isinstance(arg, fx.Node):
                continue
            dtype = node_dtype(arg)
            if dtype == FP8_DTYPE or match_static_fp8_quant(arg) is not None:
                raise ValueError(
                    f"layer {spec.name!r} is {kept} but graph node {node.name!r} writes FP8 into its "
                    f"cache: {arg_name} has dtype {dtype or FP8_DTYPE}, expected {spec.model_dtype}"
                )
    elif any(op in ops for ops in _MODE_OPS.values()):
        raise ValueError(
            f"layer {spec.name!r} is {kept} but graph node {node.name!r} runs {op_label(node)} on "
            "it, an op for quantized caches only"
        )


# the layer ops of each family of quantized modes: each layer is read by its own family's
_MODE_OPS = {
    "the fp8 per-tensor mode": (QUANT_CACHE_WRITE, QUANT_CACHE_WRITE_TS, DEQUANTIZE, ATTENTION_FP8),
    "the per-(token, head) modes": (
        CACHE_WRITE_PTH, QUANT_CACHE_WRITE_PTH, DEQUANTIZE_PTH, ATTENTION_PTH
    ),
    "tc4_per_token_head": (CACHE_WRITE_TC, QUANT_CACHE_WRITE_TC, DEQUANTIZE_TC, ATTENTION_TC),
}  # fmt: skip


def _family(stamp: KVQStamp) -> str:
    mode = stamp.spec.mode
    if mode.transform_coded:
        return "tc4_per_token_head"
    return "the per-(token, head) modes" if mode.per_token_head else "the fp8 per-tensor mode"


def _check_mode_ops(node: fx.Node, stamp: KVQStamp) -> None:
    """Refuse a quantized layer's op of another mode (each layer is read by its own mode)."""
    op = functional_op(node)
    mine = _family(stamp)
    for family, ops in _MODE_OPS.items():
        if family != mine and op in ops:
            raise ValueError(
                f"layer {stamp.layer!r} has mode {stamp.spec.mode.value} but graph node "
                f"{node.name!r} runs {op_label(node)} on it, an op of {family}"
            )


def _owner(node: fx.Node) -> fx.Node | None:
    """The stamped layer op a layer-less kvq op belongs to (a user, else the quantized attention)."""
    users = [u for n in node.users for u in (n.users if is_call(n, operator.getitem) else [n])]
    for user in users:  # through the getitems of a tuple-returning op (quantize_per_token_head)
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
