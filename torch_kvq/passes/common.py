"""What every pass shares: the ``node.meta["kvq"]`` stamp, the pass context, and node helpers.

The stamp is the only meta key we write. Passes read it (and ``target`` / ``args``), never a
global cache dtype. Helpers here only *read* graphs; each pass module does its own rewrite.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

import torch
from torch import fx

from torch_kvq.attention import ops as _ops  # noqa: F401  (registers torch.ops.kvq.*)
from torch_kvq.spec import FP8_DTYPE, FP8_MAX, LayerKVSpec

META_KEY = "kvq"

KVQ = torch.ops.kvq
QUANTIZE = KVQ.quantize_fp8.default
DEQUANTIZE = KVQ.dequantize_kv_cache.default
CACHE_WRITE = KVQ.cache_write.default
QUANT_CACHE_WRITE = KVQ.quant_cache_write.default
QUANT_CACHE_WRITE_TS = KVQ.quant_cache_write_ts.default
ATTENTION = KVQ.paged_attention.default
ATTENTION_FP8 = KVQ.paged_attention_fp8.default
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
_aten = torch.ops.aten
_CONVERT = torch.ops.prims.convert_element_type.default
_TO_COPY = _aten._to_copy.default
_CLAMP = _aten.clamp.default
_CLAMP_BOUNDS = ((_aten.clamp_min.default, "lo"), (_aten.clamp_max.default, "hi"))
_SCALINGS = (
    (_aten.div.Tensor, "div"),
    (_aten.div.Scalar, "div"),
    (_aten.mul.Tensor, "mul"),
    (_aten.mul.Scalar, "mul"),
)
_QUANT_ENDS = (QUANTIZE, _CONVERT, _TO_COPY)  # what a static FP8 quant's last node can be


def short_dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).replace("torch.", "")
    )


@dataclass(frozen=True)
class KVQStamp:
    """What ``node.meta["kvq"]`` holds: the layer's spec plus the kernel decisions for it.

    ``fp8_kv``: the layer is quantized and its kernel reads its FP8 cache in place with a
    model-dtype query (quant+write and dequant+attention may be fused). ``fp8_output``: the kernel
    also writes FP8 output for it (an output quant may be fused). ``fused`` names the fusions
    that produced this node (empty for nodes of the original graph). ``limit``: why the layer is
    outside the kernel's capability row for its shape (head size, ...), else None.
    ``fp8_output_tensor_scale``: the kernel also takes that output scale as a run-time tensor.
    """

    spec: LayerKVSpec
    kernel: str
    arch: str
    fp8_kv: bool
    fp8_output: bool
    fused: tuple[str, ...] = ()
    limit: str | None = None
    fp8_output_tensor_scale: bool = False

    @property
    def layer(self) -> str:
        return self.spec.name

    def kept_reason(self) -> str | None:
        """The decision text for a layer the fusions leave alone on purpose, else None."""
        if self.spec.is_quantized:
            return None
        dtype = short_dtype(self.spec.model_dtype)
        if self.spec.skip_reason:
            return f"kept {dtype} (skipped: {self.spec.skip_reason})"
        return f"kept {dtype} (not quantized: mode {self.spec.mode.value})"

    def kv_block(self) -> str | None:
        """Why quant+write / dequant+attention may not be fused for this layer, or None."""
        kept = self.kept_reason()
        if kept is not None:
            return kept
        if self.limit is not None:
            return f"not fused: kernel {self.kernel!r} on {self.arch} cannot serve it: {self.limit}"
        if not self.fp8_kv:
            return (
                f"not fused: kernel {self.kernel!r} on {self.arch} does not read "
                f"{self.spec.mode.value} caches with {short_dtype(self.spec.model_dtype)} q"
            )
        return None

    def output_block(self, tensor_scale: bool = False) -> str | None:
        """Why an output quant (whose scale is a run-time tensor if ``tensor_scale``) may not be
        fused into this layer's attention, or None."""
        blocked = self.kv_block()
        if blocked is not None:
            return blocked
        if not self.fp8_output:
            return (
                f"not fused: kernel {self.kernel!r} on {self.arch} does not write FP8 output for "
                f"{self.spec.mode.value} with {short_dtype(self.spec.model_dtype)} q"
            )
        if tensor_scale and not self.fp8_output_tensor_scale:
            return (
                f"not fused: the output quant's scale is a tensor, and kernel {self.kernel!r} on "
                f"{self.arch} takes the FP8 output scale only as a Python float"
            )
        return None

    def with_fused(self, what: str) -> KVQStamp:
        return replace(self, fused=(*self.fused, what))


def get_stamp(node: fx.Node) -> KVQStamp | None:
    stamp = node.meta.get(META_KEY)
    return stamp if isinstance(stamp, KVQStamp) else None


@dataclass
class PassContext:
    """Per-graph state a pass may read (the manager's stamps) and write (its decisions)."""

    stamps: Mapping[str, KVQStamp]
    decisions: dict[str, str] = field(default_factory=dict)

    def decide(self, layer: str, decision: str) -> None:
        """Record ``decision`` for ``layer`` in the current pass (the first one recorded wins)."""
        self.decisions.setdefault(layer, decision)


class KVQPass(Protocol):
    """A post-grad pass: rewrites ``graph`` in place and returns its number of matches."""

    name: ClassVar[str]

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int: ...


# ---- reading nodes -------------------------------------------------------------------------


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
    if is_call(node, _CONVERT) and node.args[1] in FLOAT_DTYPES:
        src = node.args[0]
        return src if isinstance(src, fx.Node) else None
    if is_call(node, _TO_COPY) and set(node.kwargs) <= {"dtype"}:
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


def _is_fp8_cast(node: object) -> bool:
    if is_call(node, _CONVERT):
        return node.args[1] == FP8_DTYPE
    if is_call(node, _TO_COPY):
        return node.kwargs.get("dtype") == FP8_DTYPE and set(node.kwargs) <= {"dtype"}
    return False


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


def _clamp_bounds(node: fx.Node) -> tuple[fx.Node, list[fx.Node], float, float] | None:
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
    if node.op != "call_function" or node.target not in _QUANT_ENDS:
        return None
    if node.target is QUANTIZE:
        scale = _number(op_args(node).get("scale"))
        value = op_args(node).get("x")
        if scale is None or not isinstance(value, fx.Node):
            return None
        return StaticQuant(value, scale, (node,), "op")
    if not _is_fp8_cast(node):
        return None
    nodes = [node]
    inner, casts = skip_float_casts(node.args[0])
    nodes += casts
    clamp = _clamp_bounds(inner)
    if clamp is None:
        return None
    inner, clamp_nodes, lo, hi = clamp
    if lo != -FP8_MAX or hi != FP8_MAX:
        return None
    nodes += clamp_nodes
    inner, casts = skip_float_casts(inner)
    nodes += casts
    for target, form in _SCALINGS:
        if not is_call(inner, target):
            continue
        a, b = inner.args[0], inner.args[1]
        if form == "mul" and isinstance(b, fx.Node) and _number(a) is not None:
            a, b = b, a
        if form == "div" and isinstance(a, fx.Node) and scale_tensor(b, a) is not None:
            if b is a:
                return None
            nodes.append(inner)
            return StaticQuant(a, b, tuple(reversed(nodes)), form)
        c = _number(b)
        if c is None or not isinstance(a, fx.Node) or not c > 0.0 or c == float("inf"):
            return None
        if node_dtype(inner) not in (None, torch.float32):  # x / s rounded to bf16 / fp16 first
            return None
        nodes.append(inner)
        return StaticQuant(a, c if form == "div" else 1.0 / c, tuple(reversed(nodes)), form)
    return None


def is_fp8_quant_end(node: object) -> bool:
    """True for a node producing FP8: a ``kvq.quantize_fp8`` or a cast to float8_e4m3fn."""
    return is_call(node, QUANTIZE) or _is_fp8_cast(node)


def quant_mismatch(node: fx.Node) -> str:
    """Why ``match_static_fp8_quant(node)`` does not match: the first step of the walk that fails
    (for pass decisions; call it only where the match failed)."""
    if node.op != "call_function" or node.target not in _QUANT_ENDS:
        return f"is not a static FP8 quant (it comes from {op_label(node)})"
    if node.target is QUANTIZE:
        scale = op_args(node).get("scale")
        return f"is not a static FP8 quant (kvq.quantize_fp8 with scale {scale!r})"
    if not _is_fp8_cast(node):
        return f"is not a static FP8 quant (it comes from {op_label(node)})"
    inner, _ = skip_float_casts(node.args[0])
    clamp = _clamp_bounds(inner)
    if clamp is None:
        return (
            "is not a static FP8 quant (no clamp to +-448 before the FP8 cast, found "
            f"{op_label(inner)})"
        )
    inner, _, lo, hi = clamp
    if lo != -FP8_MAX or hi != FP8_MAX:
        return f"is not a static FP8 quant (clamped to [{lo:g}, {hi:g}], expected [-448, 448])"
    inner, _ = skip_float_casts(inner)
    for target, form in _SCALINGS:
        if not is_call(inner, target):
            continue
        a, b = inner.args[0], inner.args[1]
        if form == "mul" and isinstance(b, fx.Node) and isinstance(a, fx.Node):
            return (
                "is not a static FP8 quant the passes fuse (it multiplies by a tensor; a tensor "
                "scale is fused only as x / scale)"
            )
        if form == "div" and isinstance(b, fx.Node) and isinstance(a, fx.Node):
            why = _scale_tensor_problem(b, a)
            if why is not None:
                return f"is not a static FP8 quant the passes fuse (it {why})"
        dtype = node_dtype(inner)
        if dtype not in (None, torch.float32) and _number(b if form == "div" else a) is not None:
            return (
                f"is not a static FP8 quant the passes fuse (it scales in {dtype}: the quotient "
                "is rounded to that dtype before the FP8 cast, which the fused fp32 write would "
                "not reproduce; write (x.float() / s))"
            )
        return f"is not a static FP8 quant (its scale {b!r} is not a positive finite number)"
    return (
        "is not a static FP8 quant (no division by a scale before the clamp, found "
        f"{op_label(inner)})"
    )


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
        elif _is_fp8_cast(node):
            key = "fp8_cast"
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))
