"""Post-grad FX passes for per-layer KV-cache quantization, their manager, and the backend.

``torch.compile(model, backend=kvq_backend)``; ``last_report()`` says what was fused per layer.
See ``passes/README.md`` for the graph invariants each pass keeps.
"""

from torch_kvq.passes.annotate import AnnotatePass
from torch_kvq.passes.backend import KVQBackend, kvq_backend, make_kvq_backend
from torch_kvq.passes.base import KVQPass, PassContext
from torch_kvq.passes.cleanup import CleanupPass
from torch_kvq.passes.fuse_attention_output_quant import FuseAttentionOutputQuantPass
from torch_kvq.passes.fuse_dequant_attention import FuseDequantAttentionPass
from torch_kvq.passes.fuse_quant_cache_write import FuseQuantCacheWritePass
from torch_kvq.passes.graph_utils import count_ops
from torch_kvq.passes.manager import DEFAULT_PASSES, PASSES, KVQPassManager
from torch_kvq.passes.report import GraphReport, PassStats, last_report, recent_reports
from torch_kvq.passes.stamp import KVQStamp, make_stamp

__all__ = [
    "DEFAULT_PASSES",
    "PASSES",
    "AnnotatePass",
    "CleanupPass",
    "FuseAttentionOutputQuantPass",
    "FuseDequantAttentionPass",
    "FuseQuantCacheWritePass",
    "GraphReport",
    "KVQBackend",
    "KVQPass",
    "KVQPassManager",
    "KVQStamp",
    "PassContext",
    "PassStats",
    "count_ops",
    "kvq_backend",
    "last_report",
    "make_kvq_backend",
    "make_stamp",
    "recent_reports",
]
