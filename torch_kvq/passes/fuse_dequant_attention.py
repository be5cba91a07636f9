"""fuse_dequant_attention: dequantize the cache + attention -> attention on the FP8 cache.

Applies where the attention's stamp says the layer is quantized and its kernel reads FP8 caches
in place. No dequantized copy of the cache is materialized any more::

    before:
        dequantize_kv_cache = kvq.dequantize_kv_cache(getitem_1, 0.5, 0.25, torch.float32, 'l0')
        paged_attention = kvq.paged_attention(q, dequantize_kv_cache, 'l0')
    after:
        paged_attention_fp8 = kvq.paged_attention_fp8(q, getitem_1, 0.5, 0.25, 'l0')

A per-(token, head) layer's ``kvq.dequantize_kv_cache_per_token_head(kv_cache, kv_scale, layer,
float32)`` + attention becomes ``kvq.paged_attention_per_token_head(q, kv_cache, kv_scale,
layer)``: codes and scales read in place; a ``tc4_per_token_head`` layer's
``kvq.dequantize_kv_cache_tc`` + attention becomes ``kvq.paged_attention_tc(q, kv_cache,
kv_scale, layer)``. Each layer by its own mode only (its stamp).

Skipped layers (``kvq.paged_attention`` on their model-dtype cache) are left alone.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import fx

from torch_kvq.passes.base import KVQPass, PassContext
from torch_kvq.passes.graph_utils import (
    ATTENTION,
    ATTENTION_FP8,
    ATTENTION_PTH,
    ATTENTION_TC,
    DEQUANTIZE,
    DEQUANTIZE_PTH,
    DEQUANTIZE_TC,
    erase_dead,
    is_call,
    op_args,
    op_label,
)
from torch_kvq.passes.stamp import META_KEY, get_stamp


class FuseDequantAttentionPass(KVQPass):
    """Make quantized layers' attention read the FP8 paged cache in place (see module doc)."""

    name: ClassVar[str] = "fuse_dequant_attention"
    reads_stamps: ClassVar[bool] = True
    fusion: ClassVar[str | None] = "dequant+attn"

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        for node in list(graph.nodes):
            if not is_call(node, ATTENTION):
                continue
            stamp = get_stamp(node)
            if stamp is None:
                continue
            blocked = stamp.kv_block()
            if blocked is not None:
                ctx.decide(stamp.layer, blocked)
                continue
            args = op_args(node)
            deq = args["kv_cache"]
            mode = stamp.spec.mode
            pth = mode.has_kv_scale
            want = DEQUANTIZE_TC if mode.transform_coded else DEQUANTIZE_PTH if pth else DEQUANTIZE
            if not is_call(deq, want):
                found = op_label(deq) if isinstance(deq, fx.Node) else repr(deq)
                ctx.decide(
                    stamp.layer,
                    f"not fused: the attention's cache is not kvq.{want._opname} (found {found})",
                )
                continue
            d = op_args(deq)
            if d["out_dtype"] != torch.float32:
                ctx.decide(
                    stamp.layer,
                    f"not fused: the cache is dequantized to {d['out_dtype']}, and the fused "
                    "attention reads code * scale in float32 (it would not compute the same)",
                )
                continue
            if pth:
                fused_args = (args["q"], d["kv_cache"], d["kv_scale"], args["layer_name"])
            else:
                fused_args = (
                    args["q"], d["kv_cache"], d["k_scale"], d["v_scale"], args["layer_name"]
                )  # fmt: skip
            with graph.inserting_before(node):
                target = (
                    ATTENTION_TC
                    if mode.transform_coded
                    else ATTENTION_PTH
                    if pth
                    else ATTENTION_FP8
                )
                fused = graph.call_function(target, fused_args)
            fused.meta[META_KEY] = stamp.with_fused(self.decision())
            node.replace_all_uses_with(fused)
            graph.erase_node(node)
            erase_dead(graph, [deq])
            ctx.decide(stamp.layer, self.decision())
            matches += 1
        return matches
