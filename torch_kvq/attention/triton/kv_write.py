"""The paged cache write as one Triton program: one program per token (slot -> page and offset,
load k and v, quantize, store both).

The host side (checks, which division aten uses, the launch) is ``attention/kernels/kv_write.py``
(``write_kv_triton``), which imports this module on first use. Imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_write_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    k_op,
    v_op,
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
    DIVIDE: tl.constexpr,
    SCALE_PTR: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Token ``program_id``'s k and v [KH, D] into ``cache[page, 0 / 1, offset]``. ``QUANT``:
    ``clamp(x.float() / scale, +-FP8_MAX)`` to e4m3 (round to nearest even), the division as aten
    does it: ``DIVIDE`` correctly rounded by ``k_op`` / ``v_op``, else times them (reciprocals);
    ``SCALE_PTR``: ``k_op`` / ``v_op`` point at the scales on the device."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    page = slot // page_size
    offset = slot - page * page_size
    i = tl.arange(0, BLOCK)  # (head, dim) flattened: dense in k, v and the cache
    mask = i < KH * D
    k = tl.load(k_ptr + token * k_stride_t + i, mask=mask)
    v = tl.load(v_ptr + token * v_stride_t + i, mask=mask)
    if QUANT:  # aten's x.float() / scale: correctly rounded, or times a reciprocal
        if SCALE_PTR:  # scale tensors on the device: read now (DIVIDE is then always set)
            k_s = tl.load(k_op)
            v_s = tl.load(v_op)
        else:
            k_s = k_op
            v_s = v_op
        if DIVIDE:
            k = tl.math.div_rn(k.to(tl.float32), k_s)
            v = tl.math.div_rn(v.to(tl.float32), v_s)
        else:
            k = k.to(tl.float32) * k_s
            v = v.to(tl.float32) * v_s
        k = tl.clamp(k, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        v = tl.clamp(v, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        k = k.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        v = v.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    dst = cache_ptr + page * c_stride_page + offset * c_stride_slot + i
    tl.store(dst, k, mask=mask)
    tl.store(dst + c_stride_kv, v, mask=mask)
