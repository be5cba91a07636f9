"""Matching a per-(token, head) quant in a post-grad graph (``match_per_token_head_quant``): the
codes and scales a ``kvq.cache_write_per_token_head`` writes, from the ``kvq.quantize_per_token_head``
op or from the torch-native form a model writes (``attention/quant.py``'s math)::

    xf = x.float(); s = (xf.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-6)
    codes = (xf / s).round().clamp(-128, 127).to(torch.int8); scales = s.squeeze(-1)
    (fp8: no round, clamp(-448, 448), .to(torch.float8_e4m3fn), QMAX 448)

which arrives post-grad as ``convert_element_type`` / ``abs`` / ``amax`` / ``div`` /
``clamp_min`` / ``div`` / ``round`` / ``clamp_min`` + ``clamp_max`` / ``convert_element_type`` and
``squeeze``. Where it does not match, the reason is the first step that fails (pass decisions).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from torch_kvq.attention.quant import FP8_MAX, INT8_MAX, SCALE_FLOOR
from torch_kvq.passes.graph_utils import (
    CONVERT,
    QUANTIZE_PTH,
    TO_COPY,
    VIEW_OPS,
    is_call,
    node_dtype,
    op_args,
    op_label,
    skip_float_casts,
)
from torch_kvq.passes.quant_match import clamp_bounds
from torch_kvq.spec_modes import FP8_DTYPE

_aten = torch.ops.aten
_SQUEEZES = (_aten.squeeze.dim, _aten.squeeze.dims, *VIEW_OPS)
# code dtype -> (format, clamp bounds, QMAX of the scale)
_FORMATS = {
    torch.int8: ("int8", (-128.0, 127.0), INT8_MAX),
    FP8_DTYPE: ("fp8", (-FP8_MAX, FP8_MAX), FP8_MAX),
}


@dataclass(frozen=True)
class TokenHeadQuant:
    """A matched per-(token, head) quant: ``value`` (the node quantized, before its float cast),
    ``fmt`` ("int8" / "fp8"), ``rounding`` ("half_away": the op; "half_even": ``torch.round``),
    ``nodes``: the quant's own nodes (codes and scales), in graph order."""

    value: fx.Node
    fmt: str
    rounding: str
    nodes: tuple[fx.Node, ...]


def match_per_token_head_quant(codes: object, scales: object) -> TokenHeadQuant | str:
    """The quant producing ``codes`` and ``scales`` (one quant for both), or why not."""
    if not isinstance(codes, fx.Node) or not isinstance(scales, fx.Node):
        return f"codes / scales are {codes!r} / {scales!r}, not graph values"
    if is_call(codes, operator.getitem) and is_call(codes.args[0], QUANTIZE_PTH):
        op = codes.args[0]
        if not (is_call(scales, operator.getitem) and scales.args[0] is op):
            return "codes come from kvq.quantize_per_token_head but the scales from another op"
        args = op_args(op)
        return TokenHeadQuant(args["x"], args["mode"], "half_away", (op, codes, scales))
    return _torch_form(codes, scales)


def _torch_form(codes: fx.Node, scales: fx.Node) -> TokenHeadQuant | str:
    code_dtype = codes.args[1] if is_call(codes, CONVERT) else codes.kwargs.get("dtype")
    if not is_call(codes, CONVERT, TO_COPY) or code_dtype not in _FORMATS:
        return f"is not a per-(token, head) quant (the codes come from {op_label(codes)})"
    fmt, bounds, qmax = _FORMATS[code_dtype]
    nodes = [codes]
    clamp = clamp_bounds(codes.args[0]) if isinstance(codes.args[0], fx.Node) else None
    if clamp is None or (clamp[2], clamp[3]) != bounds:
        return (
            f"is not a per-(token, head) {fmt} quant (no clamp to [{bounds[0]:g}, {bounds[1]:g}])"
        )
    inner, clamp_nodes, _, _ = clamp
    nodes += clamp_nodes
    rounding = "half_away"
    if fmt == "int8":
        if not is_call(inner, _aten.round.default):
            return f"is not a per-(token, head) int8 quant (no round, found {op_label(inner)})"
        nodes.append(inner)
        inner, rounding = inner.args[0], "half_even"
    if not is_call(inner, _aten.div.Tensor) or node_dtype(inner) not in (None, torch.float32):
        return f"is not a per-(token, head) quant (no fp32 x / scale, found {op_label(inner)})"
    nodes.append(inner)
    xf, s = inner.args
    found = _scale(s, xf, qmax)
    if isinstance(found, str):
        return found
    nodes += found
    if not (is_call(scales, *_SQUEEZES) and scales.args[0] is s):
        return "its scales are not the quant's scale with the last dim squeezed"
    nodes.append(scales)
    value, casts = skip_float_casts(xf)
    order = {n: i for i, n in enumerate(codes.graph.nodes)}
    return TokenHeadQuant(value, fmt, rounding, tuple(sorted({*nodes, *casts}, key=order.get)))


def _scale(s: object, xf: object, qmax: float) -> list[fx.Node] | str:
    """The nodes of ``clamp_min(amax(abs(xf), [-1], True) / qmax, 1e-6)``, or why not."""
    why = (
        f"is not a per-(token, head) quant (its scale is not max(absmax(x) / {qmax:g}, "
        f"{SCALE_FLOOR:g}) over the head dim)"
    )
    floor = None
    if is_call(s, _aten.clamp_min.default):
        floor, inner = s.args[1], s.args[0]
    elif is_call(s, _aten.clamp.default) and len(s.args) == 2:
        floor, inner = s.args[1], s.args[0]
    if floor != SCALE_FLOOR or not is_call(inner, _aten.div.Tensor) or inner.args[1] != qmax:
        return why
    amax = inner.args[0]
    if not is_call(amax, _aten.amax.default) or not _last_dim_keepdim(amax):
        return why
    ab = amax.args[0]
    if not is_call(ab, _aten.abs.default) or ab.args[0] is not xf:
        return why
    return [s, inner, amax, ab]


def _last_dim_keepdim(amax: fx.Node) -> bool:
    """``amax(x, [last dim], keepdim=True)``."""
    dims = amax.args[1] if len(amax.args) > 1 else amax.kwargs.get("dim")
    keep = amax.args[2] if len(amax.args) > 2 else amax.kwargs.get("keepdim", False)
    val = amax.meta.get("val")
    last = {-1} | ({val.dim() - 1} if isinstance(val, torch.Tensor) else set())
    return keep is True and isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in last
