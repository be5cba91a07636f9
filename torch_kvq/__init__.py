"""torch-kvq: per-layer KV-cache quantization as torch.compile graph passes.

The public names load on first use (module ``__getattr__``), so that ``import torch_kvq`` (and so
``kvq --help``, whose entry point is ``torch_kvq.cli``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_LAZY: dict[str, str] = {  # public name -> the module it comes from
    "Attention": "torch_kvq.attention",
    "BatchMetadata": "torch_kvq.attention",
    "PageAllocator": "torch_kvq.attention",
    "forward_context": "torch_kvq.attention",
    "AttentionLayerInfo": "torch_kvq.spec",
    "KChannelScale": "torch_kvq.spec_channels",
    "KVCacheConfig": "torch_kvq.spec",
    "KVQuantMode": "torch_kvq.spec_modes",
    "LayerKVSpec": "torch_kvq.spec",
    "format_spec_table": "torch_kvq.spec_table",
    "resolve_layer_specs": "torch_kvq.spec_resolve",
    # these import torch._inductor
    "kvq_backend": "torch_kvq.passes.backend",
    "make_kvq_backend": "torch_kvq.passes.backend",
}

if TYPE_CHECKING:
    from torch_kvq.attention import Attention, BatchMetadata, PageAllocator, forward_context
    from torch_kvq.passes.backend import kvq_backend, make_kvq_backend
    from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig, LayerKVSpec
    from torch_kvq.spec_channels import KChannelScale
    from torch_kvq.spec_modes import KVQuantMode
    from torch_kvq.spec_resolve import resolve_layer_specs
    from torch_kvq.spec_table import format_spec_table


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_kvq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Attention",
    "AttentionLayerInfo",
    "BatchMetadata",
    "KChannelScale",
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
