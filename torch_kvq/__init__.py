"""torch-kvq: per-layer KV-cache quantization as torch.compile graph passes."""

from torch_kvq.attention import Attention, BatchMetadata, PageAllocator, forward_context
from torch_kvq.spec import (
    AttentionLayerInfo,
    KVCacheConfig,
    KVQuantMode,
    LayerKVSpec,
    format_spec_table,
    resolve_layer_specs,
)

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``kvq_backend`` / ``make_kvq_backend`` load on first use (they import torch._inductor)."""
    if name in ("kvq_backend", "make_kvq_backend"):
        from torch_kvq.passes import backend

        return getattr(backend, name)
    raise AttributeError(f"module 'torch_kvq' has no attribute {name!r}")


__all__ = [
    "Attention",
    "AttentionLayerInfo",
    "BatchMetadata",
    "KVCacheConfig",
    "KVQuantMode",
    "LayerKVSpec",
    "PageAllocator",
    "format_spec_table",
    "forward_context",
    "kvq_backend",
    "make_kvq_backend",
    "resolve_layer_specs",
]
