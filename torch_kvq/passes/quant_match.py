"""Matching a static per-tensor FP8 quant in a post-grad graph (``match_static_fp8_quant``) and,
where it does not match, saying why (``quant_mismatch``): one walk serves both."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from torch_kvq.attention.quant import FP8_MAX
from torch_kvq.passes.graph_utils import (
    CONVERT,
    QUANTIZE,
    TO_COPY,
    is_call,
    is_fp8_cast,
    node_dtype,
    op_args,
    op_label,
    skip_float_casts,
)
from torch_kvq.passes.stamp import short_dtype

_aten = torch.ops.aten
_CLAMP = _aten.clamp.default
_CLAMP_BOUNDS = ((_aten.clamp_min.default, "lo"), (_aten.clamp_max.default, "hi"))
_SCALINGS = (
    (_aten.div.Tensor, "div"),
    (_aten.div.Scalar, "div"),
    (_aten.mul.Tensor, "mul"),
    (_aten.mul.Scalar, "mul"),
)
_QUANT_ENDS = (QUANTIZE, CONVERT, TO_COPY)  # what a static FP8 quant's last node can be


def _number(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def scale_tensor(x: object, value: object = None) -> fx.Node | None:
    """``x`` if it is a graph value holding a run-time scale: a float32 tensor of one element
    (a 0-d buffer or parameter, lifted to a graph input) with no more dims than ``value`` (so the
    division keeps ``value``'s shape), per ``meta["val"]``."""
    return x if isinstance(x, fx.Node) and _scale_tensor_problem(x, value) is None else None


def _scale_tensor_problem(x: fx.Node, value: object) -> str | None:
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return f"divides by {x.name}, whose value the graph does not record"
    ndim = value.meta.get("val") if isinstance(value, fx.Node) else None
    ndim = ndim.dim() if isinstance(ndim, torch.Tensor) else None
    if val.dtype != torch.float32 or val.numel() != 1 or (ndim is not None and val.dim() > ndim):
        return (
            f"divides by a {short_dtype(val.dtype)} tensor of shape {tuple(val.shape)} "
            f"({x.name}); a run-time scale must be a float32 tensor of one element"
        )
    return None


@dataclass(frozen=True)
class StaticQuant:
    """A matched static FP8 quant ``fp8(clamp(value / scale, -448, 448))``.

    ``value``: the node fed into the scaling (for the torch form, before the div/mul; float casts
    before it are not included). ``nodes``: the quant's own nodes, the final FP8 node last.
    ``scale``: a Python number, or the graph node of a run-time scale tensor (``scale_tensor``;
    only the ``div`` form: ``value / scale_tensor``). A tensor is never read at compile time.
    """

    value: fx.Node
    scale: float | fx.Node
    nodes: tuple[fx.Node, ...]
    form: str  # "op" (kvq.quantize_fp8) | "div" | "mul"

    @property
    def out(self) -> fx.Node:
        return self.nodes[-1]

    @property
    def tensor_scale(self) -> fx.Node | None:
        return self.scale if isinstance(self.scale, fx.Node) else None


def clamp_bounds(node: fx.Node) -> tuple[fx.Node, list[fx.Node], float, float] | None:
    """Match clamp(x, lo, hi) or clamp_min/clamp_max in either order: (x, nodes, lo, hi)."""
    if is_call(node, _CLAMP):
        lo = _number(node.args[1] if len(node.args) > 1 else node.kwargs.get("min"))
        hi = _number(node.args[2] if len(node.args) > 2 else node.kwargs.get("max"))
        if lo is None or hi is None or not isinstance(node.args[0], fx.Node):
            return None
        return node.args[0], [node], lo, hi
    bounds: dict[str, float] = {}
    nodes = []
    for _ in range(2):
        for target, key in _CLAMP_BOUNDS:
            if is_call(node, target) and key not in bounds and _number(node.args[1]) is not None:
                bounds[key] = _number(node.args[1])  # type: ignore[assignment]
                nodes.append(node)
                node = node.args[0]
                break
    if len(bounds) != 2 or not isinstance(node, fx.Node):
        return None
    return node, nodes, bounds["lo"], bounds["hi"]


def match_static_fp8_quant(node: fx.Node) -> StaticQuant | None:
    """Match a static per-tensor FP8 quant ending at ``node`` (the node producing FP8).

    Forms (as they arrive post-grad on torch 2.11-2.14)::

        kvq.quantize_fp8(value, scale)
        [casts] <- clamp_max(448) <- clamp_min(-448) <- [casts] <- div(value, scale)      (or clamp)
        ...                                                    <- mul(value, 1 / scale)
        ...                                                    <- div(value, scale_tensor)

    ``scale`` a positive finite Python number; ``scale_tensor`` a graph value (a 0-d / 1-element
    float32 buffer or parameter): kept as a node, its value is never baked into the graph.
    """
    found = _walk(node)
    return found if isinstance(found, StaticQuant) else None


def quant_mismatch(node: fx.Node) -> str:
    """Why ``match_static_fp8_quant(node)`` does not match: the first step of the walk that fails
    (for pass decisions; call it only where the match failed)."""
    found = _walk(node)
    return "is a static FP8 quant" if isinstance(found, StaticQuant) else found


def _walk(node: fx.Node) -> StaticQuant | str:
    """The matched quant ending at ``node``, or why it is not one (``quant_mismatch``'s text)."""
    not_quant = f"is not a static FP8 quant (it comes from {op_label(node)})"
    if node.op != "call_function" or node.target not in _QUANT_ENDS:
        return not_quant
    if node.target is QUANTIZE:
        raw = op_args(node).get("scale")
        scale, value = _number(raw), op_args(node).get("x")
        if scale is None or not isinstance(value, fx.Node):
            return f"is not a static FP8 quant (kvq.quantize_fp8 with scale {raw!r})"
        return StaticQuant(value, scale, (node,), "op")
    if not is_fp8_cast(node):
        return not_quant
    nodes = [node]
    inner, casts = skip_float_casts(node.args[0])
    nodes += casts
    clamp = clamp_bounds(inner)
    if clamp is None:
        return (
            "is not a static FP8 quant (no clamp to +-448 before the FP8 cast, found "
            f"{op_label(inner)})"
        )
    inner, clamp_nodes, lo, hi = clamp
    if lo != -FP8_MAX or hi != FP8_MAX:
        return f"is not a static FP8 quant (clamped to [{lo:g}, {hi:g}], expected [-448, 448])"
    nodes += clamp_nodes
    inner, casts = skip_float_casts(inner)
    nodes += casts
    for target, form in _SCALINGS:
        if is_call(inner, target):
            nodes.append(inner)
            return _scaling(inner, form, tuple(reversed(nodes)))
    return (
        "is not a static FP8 quant (no division by a scale before the clamp, found "
        f"{op_label(inner)})"
    )


def _scaling(inner: fx.Node, form: str, nodes: tuple[fx.Node, ...]) -> StaticQuant | str:
    """The quant whose scaling node (``div`` / ``mul``) is ``inner``, or why not."""
    a, b = inner.args[0], inner.args[1]
    if form == "mul" and isinstance(b, fx.Node):
        if isinstance(a, fx.Node):
            return (
                "is not a static FP8 quant the passes fuse (it multiplies by a tensor; a tensor "
                "scale is fused only as x / scale)"
            )
        a, b = b, a
    if form == "div" and isinstance(a, fx.Node) and isinstance(b, fx.Node):
        why = _scale_tensor_problem(b, a)
        if why is not None:
            return f"is not a static FP8 quant the passes fuse (it {why})"
        if b is not a:
            return StaticQuant(a, b, nodes, form)
    c = _number(b)
    dtype = node_dtype(inner)
    if c is not None and dtype not in (None, torch.float32):  # x / s rounded to bf16 / fp16 first
        return (
            f"is not a static FP8 quant the passes fuse (it scales in {dtype}: the quotient "
            "is rounded to that dtype before the FP8 cast, which the fused fp32 write would "
            "not reproduce; write (x.float() / s))"
        )
    if c is None or not isinstance(a, fx.Node) or not c > 0.0 or c == float("inf"):
        return f"is not a static FP8 quant (its scale {b!r} is not a positive finite number)"
    return StaticQuant(a, c if form == "div" else 1.0 / c, nodes, form)
