"""The attention runtime: layer, paged cache bookkeeping, forward context, custom ops, kernels."""

from torch_kvq.attention.allocator import OutOfPagesError, PageAllocator
from torch_kvq.attention.calibration import amax_to_scale, calibrate_kv_scales
from torch_kvq.attention.context import ForwardContext, forward_context, get_forward_context
from torch_kvq.attention.kernels import KernelUnsupportedError, ReferenceKernel, ref_attention
from torch_kvq.attention.layer import Attention
from torch_kvq.attention.metadata import BatchMetadata

__all__ = [
    "Attention",
    "BatchMetadata",
    "ForwardContext",
    "KernelUnsupportedError",
    "OutOfPagesError",
    "PageAllocator",
    "ReferenceKernel",
    "amax_to_scale",
    "calibrate_kv_scales",
    "forward_context",
    "get_forward_context",
    "ref_attention",
]
