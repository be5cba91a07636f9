"""fuse_quant_cache_write: static FP8 quant of k and v + cache write -> one quantizing write.

Applies where the write's stamp says the layer is quantized and its kernel reads FP8 caches.
The quant is the ``kvq.quantize_fp8`` op or the torch-native expression (div or mul, clamp to
+-448, cast to float8_e4m3fn, with any float casts between). The write arrives functionalized::

    before:
        quantize_fp8 = kvq.quantize_fp8(k, 0.5);  quantize_fp8_1 = kvq.quantize_fp8(v, 0.25)
        auto_functionalized_v2 = auto_functionalized_v2(kvq.cache_write, k=quantize_fp8,
            v=quantize_fp8_1, layer_name='l0', _kv_cache_base_index=0, _all_bases=[kv_cache])
        getitem_1 = auto_functionalized_v2[1]
    after:
        auto_functionalized_v2 = auto_functionalized_v2(kvq.quant_cache_write, k=k, v=v,
            k_scale=0.5, v_scale=0.25, layer_name='l0', _kv_cache_base_index=0, _all_bases=[kv_cache])
        getitem_1 = auto_functionalized_v2[1]

The k / v fed to the fused write are the quant inputs, walked back through float casts to the
layer's model dtype (the fused op quantizes in fp32 like ``kvq.quantize_fp8``).

Where both quants divide by a run-time scale tensor (``(k.float() / self.k_scale).clamp(-448,
448).to(fp8)`` with ``k_scale`` a 0-d / 1-element float32 buffer or parameter, a graph input), the
write becomes ``kvq.quant_cache_write_ts(k, v, kv_cache, k_scale_node, v_scale_node, layer)``:
the scale stays a graph value read at run time, never a constant, so changing the buffer changes
what the compiled graph writes. The write is kernel-independent (kernels/kv_write.py), so this needs
no capability bit. One scale a number and the other a tensor is left unfused (decision says so).

A per-(token, head) layer's write (``kvq.cache_write_per_token_head`` of codes and scales from
``kvq.quantize_per_token_head`` or the torch-native form, ``passes/quant_match_pth.py``) becomes
``kvq.quant_cache_write_per_token_head(k, v, kv_cache, kv_scale, layer, rounding)``, with
``rounding="half_even"`` where the matched form rounds with ``torch.round``: the same codes and
scales, bit for bit. The format must be the layer's own mode's (k's and v's: ``k_format`` /
``v_format``, which differ for ``k8v4_per_token_head``).

A ``tc4_per_token_head`` layer's write (``kvq.cache_write_tc`` of the code and side rows of
``kvq.quantize_tc(k, "k")`` and ``kvq.quantize_tc(v, "v")``) becomes
``kvq.quant_cache_write_tc(k, v, kv_cache, kv_scale, layer)``, k already in its basis (the
layer's ``basis_qk`` stays before it).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import fx

from torch_kvq.passes.base import KVQPass, PassContext
from torch_kvq.passes.graph_utils import (
    AUTO_FUNCTIONALIZED,
    CACHE_WRITE,
    CACHE_WRITE_PTH,
    CACHE_WRITE_TC,
    QUANT_CACHE_WRITE,
    QUANT_CACHE_WRITE_PTH,
    QUANT_CACHE_WRITE_TC,
    QUANT_CACHE_WRITE_TS,
    QUANTIZE_TC,
    erase_dead,
    float_cast_arg,
    functional_op,
    is_call,
    node_dtype,
    op_args,
)
from torch_kvq.passes.quant_match import StaticQuant, match_static_fp8_quant, quant_mismatch
from torch_kvq.passes.quant_match_pth import TokenHeadQuant, match_per_token_head_quant
from torch_kvq.passes.stamp import META_KEY, KVQStamp, get_stamp, short_dtype


class FuseQuantCacheWritePass(KVQPass):
    """Fuse k/v quantization into the paged-cache write for quantized layers (see module doc)."""

    name: ClassVar[str] = "fuse_quant_cache_write"
    reads_stamps: ClassVar[bool] = True
    fusion: ClassVar[str | None] = "quant+write"

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        for node in list(graph.nodes):
            if not is_call(node, *AUTO_FUNCTIONALIZED):
                continue
            op = functional_op(node)
            stamp = get_stamp(node)
            if op not in (CACHE_WRITE, CACHE_WRITE_PTH, CACHE_WRITE_TC) or stamp is None:
                continue
            blocked = stamp.kv_block()
            if blocked is not None:
                ctx.decide(stamp.layer, blocked)
                continue
            if op is CACHE_WRITE_PTH:
                matches += self._fuse_per_token_head(graph, node, stamp, ctx)
                continue
            if op is CACHE_WRITE_TC:
                matches += self._fuse_tc(graph, node, stamp, ctx)
                continue
            quants: dict[str, tuple[StaticQuant, fx.Node, list[fx.Node]]] = {}
            for arg in ("k", "v"):
                found = _match(node.kwargs[arg], stamp.spec.model_dtype)
                if isinstance(found, str):
                    ctx.decide(stamp.layer, f"not fused: {arg} {found}")
                    break
                quants[arg] = found
            if len(quants) != 2:
                continue
            tensors = [quants[a][0].tensor_scale is not None for a in ("k", "v")]
            if tensors[0] != tensors[1]:
                which = "k" if tensors[0] else "v"
                ctx.decide(
                    stamp.layer,
                    f"not fused: {which}'s quant scale is a tensor and the other's a Python number; "
                    "the fused write takes both as numbers or both as tensors",
                )
                continue
            kwargs = {key: val for key, val in node.kwargs.items() if key not in ("k", "v")}
            fused_kwargs = {
                "k": quants["k"][1],
                "v": quants["v"][1],
                "k_scale": quants["k"][0].scale,
                "v_scale": quants["v"][0].scale,
                **kwargs,
            }
            op = QUANT_CACHE_WRITE_TS if tensors[0] else QUANT_CACHE_WRITE
            self._replace(graph, node, op, fused_kwargs, stamp, quants.values(), ctx)
            matches += 1
        return matches

    def _fuse_per_token_head(
        self, graph: fx.Graph, node: fx.Node, stamp: KVQStamp, ctx: PassContext
    ) -> int:
        """Rewrite one per-(token, head) write (module doc); 1 if fused, else 0 (decided why)."""
        mode = stamp.spec.mode
        found: dict[str, tuple[TokenHeadQuant, fx.Node, list[fx.Node]]] = {}
        for arg in ("k", "v"):
            fmt = mode.k_format if arg == "k" else mode.v_format  # k8v4: int8 / int4
            quant = match_per_token_head_quant(
                node.kwargs[f"{arg}_codes"], node.kwargs[f"{arg}_scales"]
            )
            if isinstance(quant, str):
                ctx.decide(stamp.layer, f"not fused: {arg} {quant}")
                return 0
            if quant.fmt != fmt:
                ctx.decide(
                    stamp.layer,
                    f"not fused: {arg} is quantized to {quant.fmt}, and the layer's mode "
                    f"{mode.value} stores {fmt}",
                )
                return 0
            source = _model_dtype_source(quant.value, stamp.spec.model_dtype)
            if isinstance(source, str):
                ctx.decide(stamp.layer, f"not fused: {arg} {source}")
                return 0
            found[arg] = (quant, *source)
        if found["k"][0].rounding != found["v"][0].rounding:
            ctx.decide(
                stamp.layer, "not fused: k and v are rounded differently (op vs torch.round)"
            )
            return 0
        keep = {"layer_name", "_kv_cache_base_index", "_kv_scale_base_index", "_all_bases"}
        kwargs = {
            "k": found["k"][1],
            "v": found["v"][1],
            "rounding": found["k"][0].rounding,
            **{key: val for key, val in node.kwargs.items() if key in keep},
        }
        self._replace(graph, node, QUANT_CACHE_WRITE_PTH, kwargs, stamp, found.values(), ctx)
        return 1

    def _fuse_tc(self, graph: fx.Graph, node: fx.Node, stamp: KVQStamp, ctx: PassContext) -> int:
        """Rewrite one tc4 write (module doc); 1 if fused, else 0 (decided why)."""
        found = {}
        for arg in ("k", "v"):
            quant = _match_tc(node.kwargs[f"{arg}_codes"], node.kwargs[f"{arg}_aux"], arg)
            if isinstance(quant, str):
                ctx.decide(stamp.layer, f"not fused: {arg} {quant}")
                return 0
            source = _model_dtype_source(op_args(quant)["x"], stamp.spec.model_dtype)
            if isinstance(source, str):
                ctx.decide(stamp.layer, f"not fused: {arg} {source}")
                return 0
            found[arg] = (_TcQuant(quant), *source)
        keep = {"layer_name", "_kv_cache_base_index", "_kv_scale_base_index", "_all_bases"}
        kwargs = {
            "k": found["k"][1],
            "v": found["v"][1],
            **{key: val for key, val in node.kwargs.items() if key in keep},
        }
        self._replace(graph, node, QUANT_CACHE_WRITE_TC, kwargs, stamp, found.values(), ctx)
        return 1

    def _replace(
        self,
        graph: fx.Graph,
        node: fx.Node,
        op: object,
        kwargs: dict[str, object],
        stamp: KVQStamp,
        quants: Iterable[tuple[StaticQuant | TokenHeadQuant | _TcQuant, fx.Node, list[fx.Node]]],
        ctx: PassContext,
    ) -> None:
        """Put the fused write ``op`` (``kwargs``) in place of the write ``node`` and erase the
        quantizations it absorbed (``quants``: (match, source, casts) per k / v) where dead."""
        with graph.inserting_before(node):
            fused = graph.call_function(node.target, (op,), kwargs)
        fused.meta[META_KEY] = stamp.with_fused(self.decision())
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        for quant, _, casts in quants:
            erase_dead(graph, [*reversed(casts), *quant.nodes])
        ctx.decide(stamp.layer, self.decision())


def _model_dtype_source(value: fx.Node, model_dtype: object) -> tuple[fx.Node, list[fx.Node]] | str:
    """``value`` walked back through float casts to the model dtype: (source, casts passed)."""
    source, casts = value, []
    while node_dtype(source) != model_dtype:
        prev = float_cast_arg(source)
        if prev is None:
            return (
                f"reaches the quant as {node_dtype(source)}, expected the model dtype {model_dtype}"
            )
        casts.append(source)
        source = prev
    return source, casts


def _match(arg: object, model_dtype: object) -> tuple[StaticQuant, fx.Node, list[fx.Node]] | str:
    """(quant, model-dtype source, casts between them) for a write's k/v arg, or why not."""
    if not isinstance(arg, fx.Node):
        return f"is {arg!r}, not a graph value"
    quant = match_static_fp8_quant(arg)
    if quant is None:
        return quant_mismatch(arg)
    quotient = node_dtype(quant.nodes[0])
    if quant.tensor_scale is not None and quotient not in (None, torch.float32):
        return (
            f"divides a {short_dtype(quotient)} value by its scale tensor (the quotient is "
            f"rounded to {short_dtype(quotient)} before the FP8 cast), and the fused write "
            "divides in fp32, so it would not write the same bytes; quantize x.float() / scale"
        )
    source = _model_dtype_source(quant.value, model_dtype)
    return source if isinstance(source, str) else (quant, *source)


class _TcQuant:
    """A matched ``kvq.quantize_tc`` and its two getitems (``nodes``: what the fused write makes
    dead, in erase order)."""

    def __init__(self, quant: fx.Node) -> None:
        self.nodes = [*quant.users, quant]


def _match_tc(codes: object, aux: object, side: str) -> fx.Node | str:
    """The ``kvq.quantize_tc(x, side)`` whose outputs 0 and 1 are ``codes`` and ``aux``, or why
    not."""
    parts = []
    for value, index in ((codes, 0), (aux, 1)):
        if not (is_call(value, operator.getitem) and value.args[1] == index):
            return f"codes and side rows are not the outputs of one kvq.quantize_tc ({value!r})"
        parts.append(value.args[0])
    quant = parts[0]
    if parts[1] is not quant or not is_call(quant, QUANTIZE_TC):
        return "codes and side rows are not the outputs of one kvq.quantize_tc"
    if op_args(quant)["side"] != side:
        return f"is quantized as tc4's {op_args(quant)['side']!r} side, expected {side!r}"
    return quant
