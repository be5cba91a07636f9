"""Writing a batch's new k/v into a paged cache, quantizing on the way in for FP8 layers.

    kv_cache [pages, 2, page_size, KH, D]   (k at [:, 0], v at [:, 1]; FlashInfer's NHD layout)
    k, v     [T, KH, D]                     slot_mapping [T] int: page * page_size + offset

``write_kv`` is what ``kvq::cache_write`` / ``kvq::quant_cache_write`` call. On a CUDA cache it is
one Triton kernel per layer (one program per token: slot -> page and offset, load k and v, quantize,
store both); on the CPU it is ``write_kv_torch`` (aten: quantize, page/offset, two index_puts).

Both write the same bytes. Quantization is ``quantize_fp8``'s: ``clamp(x.float() / scale, ±448)``
cast to e4m3 with round-to-nearest-even, computed as aten computes ``x.float() / scale`` on the
cache's device. On CUDA aten multiplies by the fp32 reciprocal ``float(1) / float(scale)``
(``div_true_kernel_cuda`` with a CPU scalar), so the kernel does the same; bit-equality with the
unfused eager form is tested on the GPU (tests/attention/test_kv_write.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from torch_kvq.attention.kernels.base import KernelUnsupportedError, quantize_fp8
from torch_kvq.spec import FP8_DTYPE, FP8_MAX


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[float, float] | None = None,
) -> None:
    """Scatter k/v [T, KH, D] into ``kv_cache`` at ``slot_mapping`` [T] slots.

    ``scales`` = (k_scale, v_scale) quantizes model-dtype k/v into an FP8 cache; ``None`` writes
    k/v already in the cache dtype. The device picks the implementation (see the module docstring).
    """
    if kv_cache.is_cuda:
        write_kv_triton(kv_cache, k, v, slot_mapping, scales)
    else:
        write_kv_torch(kv_cache, k, v, slot_mapping, scales)


def write_kv_torch(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[float, float] | None = None,
) -> None:
    """``write_kv`` in aten ops (any device): the oracle for the Triton kernel."""
    if scales is not None:
        k, v = quantize_fp8(k, scales[0]), quantize_fp8(v, scales[1])
    page_size = kv_cache.shape[2]
    pages = torch.div(slot_mapping, page_size, rounding_mode="floor")
    offsets = slot_mapping - pages * page_size
    kv_cache[pages, 0, offsets] = k
    kv_cache[pages, 1, offsets] = v


@functools.lru_cache(maxsize=1024)
def _cuda_reciprocal(scale: float) -> float:
    """``float32(1) / float32(scale)``: the multiplier aten's CUDA ``x / scale`` uses."""
    one = torch.ones((), dtype=torch.float32)
    return float(one / torch.tensor(scale, dtype=torch.float32))


def write_kv_triton(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[float, float] | None = None,
) -> None:
    """``write_kv`` as one Triton kernel (CUDA). The cache's last two dims must be dense (k / v are
    copied first when theirs are not)."""
    if not _inner_dense(kv_cache):
        raise ValueError(
            f"write_kv_triton: kv_cache has strides {tuple(kv_cache.stride())}; expected its last "
            f"two dims dense (head stride {kv_cache.shape[-1]}, element stride 1)"
        )
    k, v = (x if _inner_dense(x) else x.contiguous() for x in (k, v))
    t, kh, d = k.shape
    if scales is not None and kv_cache.dtype != FP8_DTYPE:
        raise ValueError(f"write_kv_triton: quantizing needs an FP8 cache, got {kv_cache.dtype}")
    kernel = _triton_kernel()
    if t == 0:
        return
    k_mul, v_mul = (_cuda_reciprocal(s) for s in scales) if scales is not None else (1.0, 1.0)
    kernel[(t,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k_mul,
        v_mul,
        k.stride(0),
        v.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.shape[2],
        KH=kh,
        D=d,
        BLOCK=_next_pow2(kh * d),
        QUANT=scales is not None,
        FP8_MAX=FP8_MAX,
        num_warps=4 if kh * d <= 2048 else 8,
    )


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _inner_dense(x: torch.Tensor) -> bool:
    return x.stride(-1) == 1 and (x.shape[-2] == 1 or x.stride(-2) == x.shape[-1])


@functools.cache
def _triton_kernel() -> Any:
    """Build the Triton kernel on first use (Triton is imported only here, only for CUDA)."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:  # torch's CUDA wheels ship Triton; a CUDA build without it cannot
        raise KernelUnsupportedError(
            f"the CUDA cache write is a Triton kernel, and Triton cannot be imported ({e}); "
            "install triton (it comes with torch's CUDA wheels)"
        ) from e

    @triton.jit
    def kv_write_kernel(
        k_ptr,
        v_ptr,
        cache_ptr,
        slot_ptr,
        k_mul,
        v_mul,
        k_stride_t,
        v_stride_t,
        c_stride_page,
        c_stride_kv,
        c_stride_slot,
        page_size,
        KH: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        QUANT: tl.constexpr,
        FP8_MAX: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        page = slot // page_size
        offset = slot - page * page_size
        i = tl.arange(0, BLOCK)  # (head, dim) flattened: dense in k, v and the cache
        mask = i < KH * D
        k = tl.load(k_ptr + token * k_stride_t + i, mask=mask)
        v = tl.load(v_ptr + token * v_stride_t + i, mask=mask)
        if QUANT:
            k = k.to(tl.float32) * k_mul
            v = v.to(tl.float32) * v_mul
            k = tl.clamp(k, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            v = tl.clamp(v, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            k = k.to(tl.float8e4nv, fp_downcast_rounding="rtne")
            v = v.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        dst = cache_ptr + page * c_stride_page + offset * c_stride_slot + i
        tl.store(dst, k, mask=mask)
        tl.store(dst + c_stride_kv, v, mask=mask)

    return kv_write_kernel
