"""The forward context: per-batch runtime state set outside the compiled graph.

Like FlashInfer's plan()/run() split: the caller builds ``BatchMetadata`` and enters
``forward_context(...)``; the kernel plans once for the batch there; the ``kvq::*`` custom ops
inside the graph look the state up by layer name and only run.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from torch_kvq.attention.kernels.base import AttentionKernel
from torch_kvq.attention.metadata import BatchMetadata, GraphShape
from torch_kvq.spec import LayerKVSpec


@dataclass
class ForwardContext:
    """State the ``kvq::*`` ops read: the batch, each layer's spec and its kernel."""

    metadata: BatchMetadata
    specs: Mapping[str, LayerKVSpec]
    kernels: Mapping[str, AttentionKernel]
    plans: dict[object, object] = field(default_factory=dict)
    graph: GraphShape | None = None  # set while planning for / capturing a CUDA graph

    def spec(self, layer_name: str) -> LayerKVSpec:
        try:
            return self.specs[layer_name]
        except KeyError:
            raise KeyError(
                f"layer {layer_name!r} is not in the active forward context (it holds "
                f"{list(self.specs)[:4]}...); enter the context of the model that owns the layer"
            ) from None

    def metadata_for(self, spec: LayerKVSpec) -> BatchMetadata:
        """The page table the layer reads: its sliding window's group table, else the batch's."""
        return self.metadata.for_window(spec.sliding_window)

    def kernel(self, layer_name: str) -> AttentionKernel:
        self.spec(layer_name)
        return self.kernels[layer_name]


_local = threading.local()


def get_forward_context() -> ForwardContext:
    """The active context; raises RuntimeError if none is set."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError(
            "no kvq forward context is set: run the model inside "
            "`with forward_context(metadata, specs, kernel):` (or model.forward_context(metadata))"
        )
    return ctx


@contextlib.contextmanager
def forward_context(
    metadata: BatchMetadata,
    specs: Sequence[LayerKVSpec],
    kernel: AttentionKernel | Mapping[str, AttentionKernel],
    graph: GraphShape | None = None,
) -> Iterator[ForwardContext]:
    """Set the batch for the ops of ``specs``' layers and plan ``kernel`` for it.

    ``kernel`` is one kernel for every layer or a mapping layer name -> kernel. Each kernel's
    ``plan`` runs once here, with the specs of the layers it serves, never inside the graph.
    ``graph`` (used by ``DecodeGraphRunner``) says ``metadata`` lives in fixed buffers of that
    shape and kernels must plan into fixed buffers too, so a captured CUDA graph can replay.
    """
    spec_map: dict[str, LayerKVSpec] = {}
    for s in specs:
        if spec_map.setdefault(s.name, s) != s:
            raise ValueError(f"forward_context got two different specs for layer {s.name!r}")
    if isinstance(kernel, Mapping):
        missing = sorted(set(spec_map) - set(kernel))
        if missing:
            raise ValueError(f"no kernel given for layers {missing}")
        kernels = dict(kernel)
    else:
        kernels = {name: kernel for name in spec_map}
    for s in specs:
        if s.page_size != metadata.page_size:
            raise ValueError(
                f"layer {s.name!r} has page_size {s.page_size} but the batch metadata was built "
                f"with page_size {metadata.page_size}"
            )
    ctx = ForwardContext(metadata=metadata, specs=spec_map, kernels=kernels, graph=graph)
    by_kernel: dict[int, tuple[AttentionKernel, list[LayerKVSpec]]] = {}
    for s in specs:
        k = kernels[s.name]
        by_kernel.setdefault(id(k), (k, []))[1].append(s)
    for k, layer_specs in by_kernel.values():
        for s in layer_specs:
            k.check_supported(s)
        k.plan(ctx, layer_specs)
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = prev
