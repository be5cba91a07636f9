"""The ``tc4_per_token_head`` cache write as a Triton program (host side:
``attention/kernels/kv_write_tc.py``): one program per (token, kv head) row of k or of v, the
bytes of ``quant_tc.quantize_k`` / ``quantize_v`` (the aten form) at the row's slot.

Per group of coordinates (k: its basis's first quarter at 6 bits, the second at 4, the last half
at 3; v: each channel half rotated by its own Hadamard, at 5 and 4 bits) the clip ratios side by
side, [N, RATIOS_PAD] (a decode step's write is a few rows: its latency is the chain of the
reductions), each with ``quant_tc._group_codes``' fp32 operations one by one (the launch turns
off fma contraction, as aten's separate ops never fuse), the scale rounded to fp16 and floored at
``HALF_SCALE_MIN``, the zero point's quotient and the reciprocal correctly rounded (``div_rn``),
the squared errors summed in fp64, the first least kept; then the codes into ``quant_tc``'s rows
(k: 16-bit lanes of four codes; v: two halves' codes a byte, half 1's fifth bits a 1-bit plane in
the aux block) and the fp16 scales and zero points into the aux record (``tc4_aux``). Imports
Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_kvq.attention.triton.hadamard import walsh_hadamard
from torch_kvq.attention.triton.helpers import v_offsets
from torch_kvq.attention.triton.tc4_aux import KS, KZ, VH, VS, VZ, aux_byte


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
def _store_scale(block, offset, page_size, s, z, SCALE: tl.constexpr, ZP: tl.constexpr):
    """A group's fp16 scale as two little-endian bytes at record bytes SCALE, SCALE + 1 and its
    zero point at ZP (``tc4_aux.aux_byte``)."""
    bits = s.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    tl.store(aux_byte(block, offset, page_size, SCALE), (bits & 0xFF).to(tl.uint8))
    tl.store(aux_byte(block, offset, page_size, SCALE + 1), (bits >> 8).to(tl.uint8))
    tl.store(aux_byte(block, offset, page_size, ZP), z.to(tl.int32).to(tl.uint8))


@triton.jit
def _rotated(src, sd, sign_ptr, H: tl.constexpr, LOG2B: tl.constexpr, RSQRT_B: tl.constexpr):
    """A half of v (H channels at ``src``, stride ``sd``) rotated as ``rotation.rotate`` does over H
    channels: the signs, the butterfly, times fp32 b^-1/2."""
    c = tl.arange(0, H)
    x = tl.load(src + c * sd).to(tl.float32) * tl.load(sign_ptr + c)
    return tl.reshape(walsh_hadamard(x[:, None], H, 1, LOG2B), [H]) * RSQRT_B


@triton.jit(do_not_specialize=["k_sd", "v_sd"])
def kv_write_tc_kernel(
    k_ptr, v_ptr, cache_ptr, aux_ptr, slot_ptr, sign_ptr, ratio_ptr,
    k_st, k_sh, k_sd, v_st, v_sh, v_sd,
    c_sp, c_skv, c_ss, c_sh, c_sd, a_sp, a_sh, page_size,
    KH: tl.constexpr, D: tl.constexpr, LOG2B: tl.constexpr, RSQRT_B: tl.constexpr,
    FLOOR: tl.constexpr, HALF_MIN: tl.constexpr, NUM_RATIOS: tl.constexpr,
    RATIOS_PAD: tl.constexpr, RCP63: tl.constexpr, RCP31: tl.constexpr, RCP15: tl.constexpr,
    RCP7: tl.constexpr,
):  # fmt: skip
    """Row ``program_id(0)`` (token * KH + kv head) of k (``program_id(1)`` 0: already in its
    basis) or of v (1) into ``cache[page, 0 / 1, offset, head]`` (D / 2 bytes) and its aux
    record into the page's block of its head (``tc4_aux``: each block contiguous, ``a_sp`` /
    ``a_sh`` apart). ``sign_ptr``: the rotation's signs over D / 2 channels; ``ratio_ptr``: the
    clip ratios. Any strides for k, v and the cache (``*_s*``: token / page, k-or-v, slot, head,
    dim); ``RCP<n>``: fp32(1 / n), the products aten takes."""
    row = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    token = row // KH
    h = row - token * KH
    slot = tl.load(slot_ptr + token).to(tl.int64)
    page = slot // page_size
    offset = slot - page * page_size
    dst = cache_ptr + page * c_sp + kv * c_skv + offset * c_ss + h * c_sh
    block = aux_ptr + page * a_sp + h * a_sh
    U: tl.constexpr = D // 16  # bytes of D / 2 one-bit codes (half 1 of v's fifth bits)
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
        c_even, c_odd = tl.split(tl.reshape(c, [D // 4, 2]))
        # 16-bit lanes a | b << 6 | c_even << 10 | c_odd << 13 (exact in fp32), low byte first
        lane = (a + b * 64.0 + c_even * 1024.0 + c_odd * 8192.0).to(tl.int32)
        row_bytes = tl.reshape(tl.join(lane & 255, lane >> 8), [D // 2]).to(tl.uint8)
        tl.store(dst + tl.arange(0, D // 2) * c_sd, row_bytes)
        _store_scale(block, offset, page_size, sa, za, KS, KZ)
        _store_scale(block, offset, page_size, sb, zb, KS + 2, KZ + 1)
        _store_scale(block, offset, page_size, sc, zc, KS + 4, KZ + 2)
        tl.store(aux_byte(block, offset, page_size, 15), tl.zeros([], tl.uint8))
    else:  # v: halves rotated on their own, 5 and 4 bits
        src = v_ptr + token * v_st + h * v_sh
        x1 = _rotated(src, v_sd, sign_ptr, D // 2, LOG2B, RSQRT_B)
        x2 = _rotated(src + (D // 2) * v_sd, v_sd, sign_ptr, D // 2, LOG2B, RSQRT_B)
        c1, s1, z1 = _group(x1, ratio_ptr, D // 2, 31.0, RCP31, FLOOR, HALF_MIN, NUM_RATIOS,
                            RATIOS_PAD)  # fmt: skip
        c2, s2, z2 = _group(x2, ratio_ptr, D // 2, 15.0, RCP15, FLOOR, HALF_MIN, NUM_RATIOS,
                            RATIOS_PAD)  # fmt: skip
        hi1 = tl.floor(c1 * 0.0625)  # exact: c1 < 32
        u1 = tl.arange(0, U)
        # byte j: half 1's low 4 bits, half 2's code above them
        row_bytes = (c1 - hi1 * 16.0 + c2 * 16.0).to(tl.int32).to(tl.uint8)
        # at ``v_layout``'s positions (the tuned 4-bit decodes' operand words)
        tok, col = v_offsets(offset, tl.arange(0, D // 2), True, page_size, c_ss, c_sd, D // 2)
        tl.store(dst - offset * c_ss + tok + col, row_bytes)
        _store_scale(block, offset, page_size, s1, z1, VS, VZ)
        _store_scale(block, offset, page_size, s2, z2, VS + 2, VZ + 1)
        # fifth bits at ``quant_tc.fifth_bit_positions``: channel (2 g2 + n) U + 4 ih + il at
        # bit 4 n + il of byte 4 ih + g2 (U a multiple of 4), else channel g U + i at bit g of i
        if U % 4 == 0:
            hi1 = tl.reshape(tl.permute(tl.reshape(hi1, [4, 2, U // 4, 4]), [2, 0, 1, 3]), [D // 2])
        else:
            hi1 = tl.reshape(tl.trans(tl.reshape(hi1, [8, U])), [D // 2])
        tl.store(block + (u1 + VH) * page_size + offset, _plane(hi1, D // 2, 1))
