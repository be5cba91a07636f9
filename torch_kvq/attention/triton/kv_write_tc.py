"""The ``tc4_per_token_head`` cache write as a Triton program (host side:
``attention/kernels/kv_write_tc.py``): one program per (token, kv head) row of k or of v, the
bytes of ``quant_tc.quantize_k`` / ``quantize_v`` (the aten form) at the row's slot.

Per group of coordinates (k: its basis's first quarter at 6 bits, the second at 4, the last half
at 3; v: each channel half rotated by its own Hadamard, at 5 and 4 bits) the clip ratios side by
side, [N, RATIOS_PAD] (a decode step's write is a few rows: its latency is the chain of the
reductions), each with ``quant_tc._group_codes``' fp32 operations one by one (the launch turns
off fma contraction, as aten's separate ops never fuse), the scale rounded to fp16 and floored at
``HALF_SCALE_MIN``, the zero point's quotient and the reciprocal correctly rounded (``div_rn``),
the squared errors summed in fp64, the first least kept; then the codes into their bit planes
(nibbles, 2-bit and 1-bit planes: ``quant_tc``'s row layout) and the fp16 scales and zero points
into the row's side bytes. Imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_kvq.attention import quant_tc
from torch_kvq.attention.triton.hadamard import walsh_hadamard

# a side row's fields (``quant_tc``'s layout): k's three fp16 scales (two bytes each) and zero
# points, v's two, v's first half's fifth bits
_KS = tl.constexpr(quant_tc.AUX_K_SCALES)
_KZ = tl.constexpr(quant_tc.AUX_K_ZP)
_VS = tl.constexpr(quant_tc.AUX_V_SCALES)
_VZ = tl.constexpr(quant_tc.AUX_V_ZP)
_VH = tl.constexpr(quant_tc.AUX_V_HIGH)


@triton.jit
def _round_clamp(y, LEVELS: tl.constexpr):
    """``clamp(round_half_away(y), 0, LEVELS)`` for fp32 y: ``clamp(floor(y + 0.49999997), 0,
    LEVELS)`` (0.49999997: fp32 0.5 - 2^-25; the int4 write's form, checked up to 64.5:
    tests/attention/test_kv_write_tc.py)."""
    return tl.minimum(tl.maximum(tl.floor(y + 0.4999999701976776), 0.0), LEVELS)


@triton.jit
def _group(x, ratio_ptr, N: tl.constexpr, LEVELS: tl.constexpr, RCP: tl.constexpr,
           FLOOR: tl.constexpr, HALF_MIN: tl.constexpr, NUM_RATIOS: tl.constexpr,
           RATIOS_PAD: tl.constexpr):  # fmt: skip
    """One group x [N] fp32 -> (codes [N] fp32, scale, zero point): ``quant_tc.quantize_group``
    with ``LEVELS`` = 2^bits - 1 steps (``RCP`` = fp32(1 / LEVELS))."""
    lo0 = tl.minimum(tl.min(x, axis=0), 0.0)
    hi0 = tl.maximum(tl.max(x, axis=0), 0.0)
    i = tl.arange(0, RATIOS_PAD)
    ratio = tl.load(ratio_ptr + i, mask=i < NUM_RATIOS, other=1.0)
    lo = lo0 * ratio
    hi = hi0 * ratio
    scale = tl.maximum((hi - lo) * RCP, FLOOR)
    scale = tl.maximum(scale.to(tl.float16).to(tl.float32), HALF_MIN)
    zp = _round_clamp(tl.math.div_rn(-lo, scale), LEVELS)
    inv = tl.math.div_rn(tl.full([RATIOS_PAD], 1.0, tl.float32), scale)
    codes = _round_clamp(x[:, None] * inv[None, :] + zp[None, :], LEVELS)
    diff = ((codes - zp[None, :]) * scale[None, :] - x[:, None]).to(tl.float64)
    err = tl.where(i < NUM_RATIOS, tl.sum(diff * diff, axis=0), float("inf"))
    first = tl.min(tl.where(err == tl.min(err, axis=0), i, RATIOS_PAD), axis=0)
    pick = i == first
    s = tl.sum(tl.where(pick, scale, 0.0), axis=0)  # exact: one term is nonzero
    inv_s = tl.sum(tl.where(pick, inv, 0.0), axis=0)
    z = tl.sum(tl.where(pick, zp, 0.0), axis=0)
    return _round_clamp(x * inv_s + z, LEVELS), s, z


@triton.jit
def _plane(codes, N: tl.constexpr, BITS: tl.constexpr):
    """Codes [N] (fp32 integers below 2^BITS) -> their plane [N * BITS / 8] uint8: value j at bit
    BITS * (j % (8 / BITS)) of byte j // (8 / BITS) (``quant_tc.pack_plane``)."""
    PER: tl.constexpr = 8 // BITS
    w = (tl.full([PER], 1, tl.int32) << (tl.arange(0, PER) * BITS)).to(tl.float32)
    return tl.sum(tl.reshape(codes, [N // PER, PER]) * w[None, :], axis=1).to(tl.int32).to(tl.uint8)


@triton.jit
def _store_scale(ptr, s, z, field_stride, SCALE_FIELD: tl.constexpr, ZP_FIELD: tl.constexpr):
    """A group's fp16 scale as two little-endian bytes at fields SCALE_FIELD, + 1 and its zero
    point at ZP_FIELD of a side row (``ptr``: the row's field 0 at the token's column)."""
    bits = s.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    tl.store(ptr + SCALE_FIELD * field_stride, (bits & 0xFF).to(tl.uint8))
    tl.store(ptr + (SCALE_FIELD + 1) * field_stride, (bits >> 8).to(tl.uint8))
    tl.store(ptr + ZP_FIELD * field_stride, z.to(tl.int32).to(tl.uint8))


@triton.jit
def _rotated(src, sd, sign_ptr, H: tl.constexpr, LOG2B: tl.constexpr, RSQRT_B: tl.constexpr):
    """A half of v (H channels at ``src``, stride ``sd``) rotated as ``quant.rotate`` does over H
    channels: the signs, the butterfly, times fp32 b^-1/2."""
    c = tl.arange(0, H)
    x = tl.load(src + c * sd).to(tl.float32) * tl.load(sign_ptr + c)
    return tl.reshape(walsh_hadamard(x[:, None], H, 1, LOG2B), [H]) * RSQRT_B


@triton.jit(do_not_specialize=["k_sd", "v_sd"])
def kv_write_tc_kernel(
    k_ptr, v_ptr, cache_ptr, aux_ptr, slot_ptr, sign_ptr, ratio_ptr,
    k_st, k_sh, k_sd, v_st, v_sh, v_sd,
    c_sp, c_skv, c_ss, c_sh, c_sd, a_sp, a_sh, a_sf, a_ss, page_size,
    KH: tl.constexpr, D: tl.constexpr, LOG2B: tl.constexpr, RSQRT_B: tl.constexpr,
    FLOOR: tl.constexpr, HALF_MIN: tl.constexpr, NUM_RATIOS: tl.constexpr,
    RATIOS_PAD: tl.constexpr, RCP63: tl.constexpr, RCP31: tl.constexpr, RCP15: tl.constexpr,
    RCP7: tl.constexpr,
):  # fmt: skip
    """Row ``program_id(0)`` (token * KH + kv head) of k (``program_id(1)`` 0: already in its
    basis) or of v (1) into ``cache[page, 0 / 1, offset, head]`` (D / 2 bytes) and its side bytes
    into ``aux[page, head, field, offset]``. ``sign_ptr``: the rotation's signs over D / 2
    channels; ``ratio_ptr``: the clip ratios. Any strides (``*_s*``: token / page, k-or-v, slot,
    head, dim; ``a_sf``: a side row's field); ``RCP<n>``: fp32(1 / n), the products aten takes."""
    row = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    token = row // KH
    h = row - token * KH
    slot = tl.load(slot_ptr + token).to(tl.int64)
    page = slot // page_size
    offset = slot - page * page_size
    dst = cache_ptr + page * c_sp + kv * c_skv + offset * c_ss + h * c_sh
    side = aux_ptr + page * a_sp + h * a_sh + offset * a_ss
    U: tl.constexpr = D // 16  # bytes of D / 2 one-bit codes (and a unit of the row's fields)
    if kv == 0:  # k: A [0, D/4) 6 bits, B [D/4, D/2) 4 bits, C [D/2, D) 3 bits; no rotation
        src = k_ptr + token * k_st + h * k_sh
        q = tl.arange(0, D // 4)
        xa = tl.load(src + q * k_sd).to(tl.float32)
        xb = tl.load(src + (q + D // 4) * k_sd).to(tl.float32)
        xc = tl.load(src + (tl.arange(0, D // 2) + D // 2) * k_sd).to(tl.float32)
        a, sa, za = _group(xa, ratio_ptr, D // 4, 63.0, RCP63, FLOOR, HALF_MIN, NUM_RATIOS,
                           RATIOS_PAD)  # fmt: skip
        b, sb, zb = _group(xb, ratio_ptr, D // 4, 15.0, RCP15, FLOOR, HALF_MIN, NUM_RATIOS,
                           RATIOS_PAD)  # fmt: skip
        c, sc, zc = _group(xc, ratio_ptr, D // 2, 7.0, RCP7, FLOOR, HALF_MIN, NUM_RATIOS,
                           RATIOS_PAD)  # fmt: skip
        a_hi = tl.floor(a * 0.0625)  # exact: a < 64
        c_hi = tl.floor(c * 0.25)
        u2, u1 = tl.arange(0, 2 * U), tl.arange(0, U)
        tl.store(dst + u2 * c_sd, _plane(a - a_hi * 16.0, D // 4, 4))
        tl.store(dst + (u2 + 2 * U) * c_sd, _plane(b, D // 4, 4))
        tl.store(dst + (u1 + 4 * U) * c_sd, _plane(a_hi, D // 4, 2))
        tl.store(dst + (u2 + 5 * U) * c_sd, _plane(c - c_hi * 4.0, D // 2, 2))
        tl.store(dst + (u1 + 7 * U) * c_sd, _plane(c_hi, D // 2, 1))
        _store_scale(side, sa, za, a_sf, _KS, _KZ)
        _store_scale(side, sb, zb, a_sf, _KS + 2, _KZ + 1)
        _store_scale(side, sc, zc, a_sf, _KS + 4, _KZ + 2)
    else:  # v: halves rotated on their own, 5 and 4 bits
        src = v_ptr + token * v_st + h * v_sh
        x1 = _rotated(src, v_sd, sign_ptr, D // 2, LOG2B, RSQRT_B)
        x2 = _rotated(src + (D // 2) * v_sd, v_sd, sign_ptr, D // 2, LOG2B, RSQRT_B)
        c1, s1, z1 = _group(x1, ratio_ptr, D // 2, 31.0, RCP31, FLOOR, HALF_MIN, NUM_RATIOS,
                            RATIOS_PAD)  # fmt: skip
        c2, s2, z2 = _group(x2, ratio_ptr, D // 2, 15.0, RCP15, FLOOR, HALF_MIN, NUM_RATIOS,
                            RATIOS_PAD)  # fmt: skip
        hi1 = tl.floor(c1 * 0.0625)  # exact: c1 < 32
        u4, u1 = tl.arange(0, 4 * U), tl.arange(0, U)
        tl.store(dst + u4 * c_sd, _plane(c1 - hi1 * 16.0, D // 2, 4))
        tl.store(dst + (u4 + 4 * U) * c_sd, _plane(c2, D // 2, 4))
        _store_scale(side, s1, z1, a_sf, _VS, _VZ)
        _store_scale(side, s2, z2, a_sf, _VS + 2, _VZ + 1)
        tl.store(side + (u1 + _VH) * a_sf, _plane(hi1, D // 2, 1))
