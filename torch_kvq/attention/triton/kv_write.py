"""The paged cache writes as Triton programs, one program per token (slot -> page and offset,
load k and v, quantize, store): ``kv_write_kernel`` (model-dtype or FP8-per-tensor caches) and
``kv_write_per_token_head_kernel`` (int8 / e4m3 codes plus one fp32 scale per kv head).

The host side (checks, which division aten uses, the launch) is ``attention/kernels/kv_write.py``
(``write_kv_triton``, ``write_kv_per_token_head``), which imports this module on first use.
Imports Triton.
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


@triton.jit
def _quantize_heads(x, mask, qmax_op, QMAX: tl.constexpr, FLOOR: tl.constexpr,
                    DIVIDE: tl.constexpr, INT8: tl.constexpr, HALF_AWAY: tl.constexpr):  # fmt: skip
    """Rows of x [BLOCK_H, BLOCK_D] (one kv head each; ``mask`` the real elements) -> (codes,
    scales [BLOCK_H] fp32) as ``quant.quantize_per_token_head`` computes them: ``absmax / QMAX``
    as aten does (``DIVIDE``: correctly rounded by ``qmax_op``, else times ``qmax_op``, the
    reciprocal), ``x / scale`` correctly rounded, int8 rounded exactly (trunc plus the fraction's
    verdict), clamped and cast; e4m3 clamped and cast with round to nearest even."""
    x = x.to(tl.float32)
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
    if DIVIDE:
        s = tl.math.div_rn(amax, qmax_op)
    else:
        s = amax * qmax_op
    s = tl.maximum(s, FLOOR, propagate_nan=tl.PropagateNan.ALL)
    y = tl.math.div_rn(x, s[:, None])
    if INT8:
        t = y.to(tl.int32)  # toward zero; |y| <= 127 (plus rounding) by construction
        tf = t.to(tl.float32)
        frac = tl.abs(y - tf)  # exact
        if HALF_AWAY:
            up = frac >= 0.5
        else:  # ties to even, as torch.round
            up = (frac > 0.5) | ((frac == 0.5) & ((t & 1) != 0))
        r = tf + tl.where(up, tl.where(y < 0.0, -1.0, 1.0), 0.0)
        codes = tl.clamp(r, -128.0, 127.0).to(tl.int8)
    else:
        y = tl.clamp(y, -QMAX, QMAX, propagate_nan=tl.PropagateNan.ALL)
        codes = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return codes, s


@triton.jit
def kv_write_per_token_head_kernel(
    k_ptr, v_ptr, cache_ptr, scale_ptr, slot_ptr, qmax_op,
    k_st, k_sh, k_sd, v_st, v_sh, v_sd,
    c_sp, c_skv, c_ss, c_sh, c_sd, s_sp, s_skv, s_sh, s_ss, page_size,
    KH: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr, FLOOR: tl.constexpr, DIVIDE: tl.constexpr, INT8: tl.constexpr,
    HALF_AWAY: tl.constexpr,
):  # fmt: skip
    """Token ``program_id``'s k and v [KH, D], quantized per kv head (``_quantize_heads``): codes
    into ``cache[page, 0 / 1, offset]``, scales into ``scale[page, 0 / 1, :, offset]``. Any
    strides (``*_s*``: token / page, k-or-v, slot, head, dim)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    page = slot // page_size
    offset = slot - page * page_size
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < KH) & (d[None, :] < D)
    k = tl.load(k_ptr + token * k_st + h[:, None] * k_sh + d[None, :] * k_sd, mask=mask, other=0.0)
    v = tl.load(v_ptr + token * v_st + h[:, None] * v_sh + d[None, :] * v_sd, mask=mask, other=0.0)
    kc, ks = _quantize_heads(k, mask, qmax_op, QMAX, FLOOR, DIVIDE, INT8, HALF_AWAY)
    vc, vs = _quantize_heads(v, mask, qmax_op, QMAX, FLOOR, DIVIDE, INT8, HALF_AWAY)
    dst = cache_ptr + page * c_sp + offset * c_ss + h[:, None] * c_sh + d[None, :] * c_sd
    tl.store(dst, kc, mask=mask)
    tl.store(dst + c_skv, vc, mask=mask)
    sdst = scale_ptr + page * s_sp + offset * s_ss + h * s_sh
    tl.store(sdst, ks, mask=h < KH)
    tl.store(sdst + s_skv, vs, mask=h < KH)
