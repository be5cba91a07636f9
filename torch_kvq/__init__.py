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
    "resolve_layer_specs",
]
