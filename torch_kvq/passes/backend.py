"""``kvq_backend`` / ``make_kvq_backend``: torch.compile backends that run the kvq passes.

``torch.compile(model, backend=kvq_backend)``: the backend scans the Dynamo graph for kvq ops'
``layer_name`` arguments, resolves those layers' specs (live-layer registry), their device arch,
and the kernel serving each (the ``kernel`` option, else the kernel of the active forward
context; with neither it refuses: it never guesses a kernel from the device), builds a
``KVQPassManager`` for exactly those layers and hands the graph to Inductor with the manager as
``post_grad_custom_post_pass``. A kernel is named by its capability-table key: a kernel object's
``name`` (``FlashInferKernel(fp8_decode="xqa", phases="decode").name`` is
``"flashinfer-xqa-decode"``, whose row claims FP8 output on sm90) or the name itself.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

from torch_kvq import progress
from torch_kvq.attention import registry
from torch_kvq.attention.context import get_forward_context
from torch_kvq.attention.kernels import capabilities as caps
from torch_kvq.attention.kernels.base import AttentionKernel
from torch_kvq.passes import report
from torch_kvq.passes.base import KVQPass
from torch_kvq.passes.manager import DEFAULT_PASSES, KVQPassManager, stamp_row
from torch_kvq.spec import LayerKVSpec

logger = logging.getLogger("torch_kvq")
INNER = ("inductor", "eager")
DUMP_ENV = "TORCH_KVQ_DUMP_DIR"  # dump folder when make_kvq_backend(dump_dir=None)
# pass reports of recent compiles, by graph key, for FX-graph-cache hits in this process (the
# newest MEMO_SIZE; older ones are read back from the file beside Inductor's cache)
MEMO_SIZE = 256
_memo: OrderedDict[str, str] = OrderedDict()
KernelChoice = str | AttentionKernel | Mapping[str, str | AttentionKernel] | None


def kernel_name(value: object, what: str = "kernel") -> str:
    """The capability-table name of a kernel object (its ``name``) or of a kernel name; a
    ValueError naming ``value`` for anything else or a name the table does not know."""
    if isinstance(value, str):
        name = value
    elif isinstance(value, AttentionKernel) and isinstance(value.name, str):
        name = value.name
    else:
        raise ValueError(
            f"{what} must be an attention kernel (an AttentionKernel such as FlashInferKernel(...)) "
            f"or a kernel name in {list(caps.known_kernels())}, got {value!r}"
        )
    if name not in caps.known_kernels():
        raise ValueError(
            f"{what} {value!r}: unknown kernel {name!r}; the capability table knows "
            f"{list(caps.known_kernels())}"
        )
    return name


def graph_layers(gm: fx.GraphModule) -> dict[str, torch.device | None]:
    """Layer names used by kvq ops in a Dynamo graph -> the device of the op's first tensor arg."""
    found: dict[str, torch.device | None] = {}
    for node in gm.graph.nodes:
        packet = getattr(node.target, "overloadpacket", node.target)
        if node.op != "call_function" or not getattr(packet, "_qualified_op_name", "").startswith(
            "kvq::"
        ):
            continue
        names = [a.name for a in packet.default._schema.arguments]
        bound = dict(zip(names, node.args)) | dict(node.kwargs)
        layer = bound.get("layer_name")
        if not isinstance(layer, str):
            continue
        vals = [
            a.meta.get("example_value", a.meta.get("val"))
            for a in node.args
            if isinstance(a, fx.Node)
        ]
        device = next((v.device for v in vals if isinstance(v, torch.Tensor)), None)
        found.setdefault(layer, device)
    return found


class KVQBackend:
    """A torch.compile backend running the kvq passes (see module doc), also named
    ``make_kvq_backend``: ``inner`` ``"inductor"`` (default) or ``"eager"`` (passes, no codegen);
    ``passes`` (in order: names in ``PASSES`` or ``KVQPass`` objects, your own passes too);
    ``dump_dir`` (per-pass before/after dumps); ``kernel`` (a kernel object such as
    ``FlashInferKernel(...)``, a kernel name, or a mapping layer -> either, overriding the forward
    context's; None: the forward context's, an error without one); ``config_patches`` (extra
    Inductor config)."""

    def __init__(
        self,
        inner: str = "inductor",
        passes: Sequence[str | KVQPass] = DEFAULT_PASSES,
        dump_dir: str | Path | None = None,
        kernel: KernelChoice = None,
        config_patches: Mapping[str, Any] | None = None,
    ) -> None:
        self.kernel_names: str | dict[str, str] | None = None  # ``kernel`` as table names
        if isinstance(kernel, Mapping):
            self.kernel_names = {
                n: kernel_name(k, f"kernel for layer {n!r}") for n, k in kernel.items()
            }
        elif kernel is not None:
            self.kernel_names = kernel_name(kernel)
        if inner not in INNER:
            raise ValueError(f"inner compiler {inner!r} unknown; expected one of {INNER}")
        if config_patches and "post_grad_custom_post_pass" in config_patches:
            raise ValueError(
                "config_patches may not set post_grad_custom_post_pass: kvq_backend installs its own"
            )
        self.inner = inner
        KVQPassManager([], passes=passes)  # validate the pass list now, not at first compile
        self.passes = tuple(passes)
        self.dump_dir = dump_dir
        self.kernel = kernel
        self.config_patches = dict(config_patches or {})
        self.managers: deque[KVQPassManager] = deque(maxlen=16)
        self.graphs: deque[fx.GraphModule] = deque(maxlen=16)  # inner="eager": the graphs that run

    def manager_for(self, gm: fx.GraphModule) -> KVQPassManager:
        """The pass manager for exactly the layers of the Dynamo graph ``gm``."""
        specs: list[LayerKVSpec] = []
        kernels: dict[str, str] = {}
        archs: dict[str, str] = {}
        for layer, device in graph_layers(gm).items():
            try:
                spec = registry.lookup(layer)
            except KeyError as e:
                raise ValueError(f"the graph uses attention layer {layer!r}: {e.args[0]}") from None
            specs.append(spec)
            archs[layer] = caps.device_arch(device) if device is not None else "cpu"
            kernels[layer] = self._kernel_name(layer)
        dump_dir = self.dump_dir if self.dump_dir is not None else os.environ.get(DUMP_ENV) or None
        return KVQPassManager(
            specs, kernel=kernels, arch=archs, passes=self.passes, dump_dir=dump_dir
        )

    def _kernel_name(self, layer: str) -> str:
        names = self.kernel_names
        if isinstance(names, str):
            return names
        if isinstance(names, dict):
            if layer not in names:
                raise ValueError(f"kernel mapping has no entry for layer {layer!r}")
            return names[layer]
        try:
            k = get_forward_context().kernels.get(layer)
            missing = "the active forward context has no kernel for it"
        except RuntimeError:
            k, missing = None, "no forward context is active"
        if k is None:
            raise ValueError(
                f"no kernel for attention layer {layer!r}: make_kvq_backend was given none and "
                f"{missing}. Pass make_kvq_backend(kernel=...) (a kernel such as "
                "FlashInferKernel(...), a kernel name, or a mapping layer -> either), or run the "
                "compiled model's first call inside forward_context(...)"
            )
        # the context already runs ``k`` (duck-typed): only its table name matters here
        name = getattr(k, "name", None)
        return kernel_name(k if not isinstance(name, str) else name, f"layer {layer!r}'s kernel")

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        manager = self.manager_for(gm)
        self.managers.append(manager)
        n = len(manager.specs)
        then = "Inductor" if self.inner == "inductor" else "no codegen"
        what = f"compiling: kvq passes + {then} ({n} attention layer{'s' if n != 1 else ''})"
        with progress.activity(what):  # a ticking line on a terminal, else nothing
            if self.inner == "eager":
                return self._eager(gm, example_inputs, manager)
            return self._inductor(gm, example_inputs, manager)

    def _eager(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], manager: KVQPassManager
    ) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table

        def fw_compiler(fx_gm: fx.GraphModule, _: Sequence[Any]) -> fx.GraphModule:
            manager(fx_gm.graph)
            fx_gm.recompile()
            self.graphs.append(fx_gm)
            return fx_gm

        aot = aot_autograd(
            fw_compiler=fw_compiler,
            decompositions=select_decomp_table(),
            keep_inference_input_mutations=True,
        )
        return aot(gm, example_inputs)

    def _inductor(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], manager: KVQPassManager
    ) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        current = torch._inductor.config.post_grad_custom_post_pass
        if current is not None and not isinstance(current, KVQPassManager):
            raise ValueError(
                f"torch._inductor.config.post_grad_custom_post_pass is already set to {current!r}; "
                "kvq_backend installs its own pass manager there. Unset it, or run your pass "
                "as post_grad_custom_pre_pass"
            )
        runs = manager.runs
        patches = {**self.config_patches, "post_grad_custom_post_pass": manager}
        if manager.dump_dir is not None:  # a cache hit would skip the passes and so the dumps
            patches["fx_graph_cache"] = False
        compiled = compile_fx(gm, list(example_inputs), config_patches=patches)
        key = _memo_key(manager, gm, example_inputs)
        if manager.runs > runs and manager.last is not None:
            _remember(key, manager.last)
        else:
            _recall(key, manager)
        return compiled


def _memo_key(manager: KVQPassManager, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    shapes = [  # sizes of dynamic dims arrive as int inputs: their values do not key a graph
        (tuple(x.shape), str(x.dtype), str(x.device))
        if isinstance(x, torch.Tensor)
        else type(x).__name__
        for x in example_inputs
    ]
    return hashlib.sha256(f"{manager.uuid()}\n{gm.code}\n{shapes}".encode()).hexdigest()


def _memo_file(key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "kvq_reports" / f"{key}.json"


def _remember(key: str, rep: report.GraphReport) -> None:
    text = rep.to_json()
    _memo[key] = text
    _memo.move_to_end(key)
    while len(_memo) > MEMO_SIZE:
        _memo.popitem(last=False)
    try:
        path = _memo_file(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as e:  # the report is informational; the compiled graph does not depend on it
        logger.debug("kvq: could not store the pass report beside Inductor's cache: %s", e)


def _recall(key: str, manager: KVQPassManager) -> None:
    """Inductor reused a compiled graph, so the passes did not run: record the report of the
    compile that made it (kept in memory and beside Inductor's cache), marked as a cache hit."""
    text = _memo.get(key)
    if text is None:
        path = _memo_file(key)
        text = path.read_text() if path.exists() else None
    if text is not None:
        rep = report.GraphReport.from_json(text)
        rep.source = "fx graph cache hit"
    else:
        layers = {n: stamp_row(s) for n, s in manager.stamps.items()}
        rep = report.GraphReport(
            -1, layers, {}, {}, {}, 0.0, source="fx graph cache hit (no stored report)"
        )
    rep.graph_id = report.next_graph_id()
    report.record(rep)
    manager.last = rep
    logger.info(rep.summary())


make_kvq_backend = KVQBackend
_default: KVQBackend | None = None


def kvq_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """``torch.compile(model, backend=kvq_backend)``: the kvq passes, then Inductor."""
    global _default
    if _default is None:
        _default = KVQBackend()
    return _default(gm, example_inputs)
