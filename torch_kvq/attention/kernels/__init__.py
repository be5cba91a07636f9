"""Attention kernels behind the ``kvq::*`` ops: ``reference`` (pure torch) and ``flashinfer`` (GPU)."""

from torch_kvq.attention.kernels.base import AttentionKernel, KernelUnsupportedError
from torch_kvq.attention.kernels.flashinfer import FlashInferKernel  # never imports flashinfer
from torch_kvq.attention.kernels.reference import ReferenceKernel, ref_attention

__all__ = [
    "AttentionKernel",
    "FlashInferKernel",
    "KernelUnsupportedError",
    "ReferenceKernel",
    "ref_attention",
]
