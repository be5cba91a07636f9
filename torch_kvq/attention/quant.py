"""Quantization math, one home per cache format: pure functions on tensors.

The ops, the ``Attention`` layer, the kernels and the passes take the math from here, so the
fused kernels, the unfused eager form and the expression the passes match agree by
construction. A scale is the dequantization factor (``real ~= stored * scale``); which dtype a
mode stores is the spec's (``spec.FP8_DTYPE``).

FP8 per tensor (``KVQuantMode.FP8_PER_TENSOR``, e4m3): ``stored = clamp(x.float() / scale,
-FP8_MAX, FP8_MAX)`` cast to e4m3 (round to nearest even), ``real = stored.float() * scale``, one
static scale per layer for k and one for v.
"""

from __future__ import annotations

import torch

from torch_kvq.spec import FP8_DTYPE

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def quantize_fp8(
    x: torch.Tensor, scale: float | torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Static per-tensor FP8: ``clamp(x.float() / scale, -FP8_MAX, FP8_MAX)`` cast to e4m3.
    ``scale`` is a Python float or a 1-element float32 tensor (divided as aten divides by it).

    Traced, this is the torch-native static quant the passes match (``passes/quant_match.py``)
    and fuse. ``out`` (float8_e4m3fn, x's shape) receives the result: the same cast (``.to`` is
    a copy_), so the same bits, in ``out``'s layout instead of one that follows x's strides.
    """
    y = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
    return y.to(FP8_DTYPE) if out is None else out.copy_(y)


def dequantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """FP8 values back to real ones, in fp32: ``x.float() * scale``."""
    return x.float() * scale


def dequantize_fp8_kv_cache(kv_pages: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """FP8 cache pages [n, 2, page, KH, D] (K at ``[:, 0]``, V at ``[:, 1]``) dequantized in fp32:
    ``code.float() * scale``, never rounded to the model dtype (what the fused kernels read)."""
    scales = torch.tensor([k_scale, v_scale], dtype=torch.float32, device=kv_pages.device)
    return kv_pages.float() * scales.view(1, 2, 1, 1, 1)
