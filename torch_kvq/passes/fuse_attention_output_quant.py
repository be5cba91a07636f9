"""fuse_attention_output_quant: FP8 attention + static FP8 quant of its output -> FP8 output.

The ``test_fusion_attn.py`` scenario: the attention output is reshaped for ``o_proj`` and
quantized with a static scale. Applies only where the attention's stamp says its kernel really
writes FP8 output for that layer (the capability table) and every node between the attention
and the quant has no other user::

    before:
        paged_attention_fp8 = kvq.paged_attention_fp8(q, getitem_1, 0.5, 0.25, 'l0')
        view = aten.reshape(paged_attention_fp8, [7, -1])
        div = aten.div.Tensor(view, 0.1)      # or mul(view, 10.0), or kvq.quantize_fp8(view, 0.1)
        convert_element_type = prims.convert_element_type(div, torch.float32)
        clamp_min = aten.clamp_min(convert_element_type, -448);  clamp_max = aten.clamp_max(clamp_min, 448)
        convert_element_type_2 = prims.convert_element_type(clamp_max, torch.float8_e4m3fn)
    after:
        paged_attention_fp8_1 = kvq.paged_attention_fp8(q, getitem_1, 0.5, 0.25, 'l0', output_scale=0.1)
        reshape = aten.reshape(paged_attention_fp8_1, [7, -1])

Only ``paged_attention_fp8`` is fused (a skipped layer's ``kvq.paged_attention`` never is). For a
quantized layer whose output is not statically quantized the decision says so.

A quant dividing by a run-time scale tensor (``view / self.out_scale``, a 0-d / 1-element float32
buffer or parameter: vLLM's test_fusion_attn.py form) becomes ``paged_attention_fp8(...,
output_scale_tensor=out_scale)``: the tensor stays a graph input read at run time, never a baked
constant. Only where the stamp says the kernel takes a tensor output scale (the capability row's
``tensor_output_scale``: the reference kernel yes, FlashInfer XQA no, its ``o_scale`` is a float).
"""

from __future__ import annotations

from typing import ClassVar

from torch import fx

from torch_kvq.passes.base import KVQPass, PassContext
from torch_kvq.passes.graph_utils import (
    ATTENTION,
    ATTENTION_FP8,
    VIEW_OPS,
    erase_dead,
    has_output_scale,
    is_call,
    is_fp8_quant_end,
    op_args,
    single_user_chain,
    skip_float_casts,
)
from torch_kvq.passes.quant_match import StaticQuant, match_static_fp8_quant, quant_mismatch
from torch_kvq.passes.stamp import META_KEY, get_stamp


class FuseAttentionOutputQuantPass(KVQPass):
    """Fuse a static FP8 quant of an FP8 attention's output into the attention (see module doc)."""

    name: ClassVar[str] = "fuse_attention_output_quant"
    reads_stamps: ClassVar[bool] = True
    fusion: ClassVar[str | None] = "output quant"

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        matches = 0
        for node in list(graph.nodes):
            if getattr(node, "_erased", False):
                continue
            quant = match_static_fp8_quant(node)
            if quant is None:
                continue
            found = _attention_before(quant)
            if found is None:
                continue
            attn, between = found
            stamp = get_stamp(attn)
            if stamp is None:
                continue
            if is_call(attn, ATTENTION):
                ctx.decide(
                    stamp.layer,
                    stamp.kv_block() or "not fused: its attention still reads a dequantized cache",
                )
                continue
            args = op_args(attn)
            if has_output_scale(attn):
                continue
            blocked = stamp.output_block(tensor_scale=quant.tensor_scale is not None)
            if blocked is not None:
                ctx.decide(stamp.layer, blocked)
                continue
            shared = single_user_chain([attn, *between, *quant.nodes])
            if shared is not None:
                ctx.decide(
                    stamp.layer,
                    f"not fused: {shared.name} between the attention and the quant has {len(shared.users)} users",
                )
                continue
            self._rewrite(graph, attn, args, between, quant)
            ctx.decide(stamp.layer, self.decision())
            matches += 1
        for node in graph.nodes:
            stamp = get_stamp(node)
            if is_call(node, ATTENTION_FP8) and stamp is not None and not has_output_scale(node):
                ctx.decide(stamp.layer, _no_quant_reason(node))
            elif is_call(node, ATTENTION) and stamp is not None:
                ctx.decide(
                    stamp.layer,
                    stamp.kv_block() or "not fused: its attention still reads a dequantized cache",
                )
        return matches

    @classmethod
    def _rewrite(
        cls, graph: fx.Graph, attn: fx.Node, args: dict, between: list[fx.Node], quant: StaticQuant
    ) -> None:
        stamp = get_stamp(attn)
        assert stamp is not None
        scale = quant.tensor_scale
        kwargs = {"output_scale": quant.scale} if scale is None else {"output_scale_tensor": scale}
        with graph.inserting_before(quant.out):
            out = graph.call_function(
                ATTENTION_FP8,
                (args["q"], args["kv_cache"], args["k_scale"], args["v_scale"], args["layer_name"]),
                kwargs,
            )
            out.meta[META_KEY] = stamp.with_fused(cls.decision())
            for view in between:
                if is_call(view, *VIEW_OPS):
                    out = graph.call_function(view.target, (out, *view.args[1:]), dict(view.kwargs))
        quant.out.replace_all_uses_with(out)
        erase_dead(graph, [attn, *between, *quant.nodes])


def _no_quant_reason(attn: fx.Node, depth: int = 8) -> str:
    """The decision for an FP8 attention left without ``output_scale``: what the FP8 cast found
    downstream of it (within ``depth`` nodes) is, else that there is none."""
    frontier, seen = list(attn.users), set()
    for _ in range(depth):
        nxt = []
        for node in frontier:
            if node in seen or node.op != "call_function":
                continue
            seen.add(node)
            if is_fp8_quant_end(node):
                return f"not fused: the attention output's FP8 quant {quant_mismatch(node)}"
            nxt.extend(node.users)
        frontier = nxt
    return "not fused: no static FP8 quant of the attention output"


def _attention_before(quant: StaticQuant) -> tuple[fx.Node, list[fx.Node]] | None:
    """The attention node the quant's value comes from through views and float casts, and the
    nodes in between (attention first), else None."""
    between: list[fx.Node] = []
    src = quant.value
    while True:
        src, casts = skip_float_casts(src)
        between += casts
        if is_call(src, ATTENTION, ATTENTION_FP8):
            return src, list(reversed(between))
        if not is_call(src, *VIEW_OPS) or not isinstance(src.args[0], fx.Node):
            return None
        between.append(src)
        src = src.args[0]
