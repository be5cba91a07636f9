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
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import fx

from torch_kvq.passes.base import KVQPass, PassContext
from torch_kvq.passes.graph_utils import (
    AUTO_FUNCTIONALIZED,
    CACHE_WRITE,
    QUANT_CACHE_WRITE,
    QUANT_CACHE_WRITE_TS,
    erase_dead,
    float_cast_arg,
    functional_op,
    is_call,
    node_dtype,
)
from torch_kvq.passes.quant_match import StaticQuant, match_static_fp8_quant, quant_mismatch
from torch_kvq.passes.stamp import META_KEY, get_stamp, short_dtype


class FuseQuantCacheWritePass(KVQPass):
    """Fuse k/v quantization into the paged-cache write for quantized layers (see module doc)."""

    name: ClassVar[str] = "fuse_quant_cache_write"
    reads_stamps: ClassVar[bool] = True
    fusion: ClassVar[str | None] = "quant+write"

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        for node in list(graph.nodes):
            if not is_call(node, *AUTO_FUNCTIONALIZED) or functional_op(node) is not CACHE_WRITE:
                continue
            stamp = get_stamp(node)
            if stamp is None:
                continue
            blocked = stamp.kv_block()
            if blocked is not None:
                ctx.decide(stamp.layer, blocked)
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
            with graph.inserting_before(node):
                fused = graph.call_function(node.target, (op,), fused_kwargs)
            fused.meta[META_KEY] = stamp.with_fused(self.decision())
            node.replace_all_uses_with(fused)
            graph.erase_node(node)
            for quant, _, casts in quants.values():
                erase_dead(graph, [*reversed(casts), *quant.nodes])
            ctx.decide(stamp.layer, self.decision())
            matches += 1
        return matches


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
    source, casts = quant.value, []
    while node_dtype(source) != model_dtype:
        prev = float_cast_arg(source)
        if prev is None:
            return (
                f"reaches the quant as {node_dtype(source)}, expected the model dtype {model_dtype}"
            )
        casts.append(source)
        source = prev
    return quant, source, casts
