"""The paged cache writes as Triton programs (slot -> page and offset, load k and v, quantize,
store): ``kv_write_kernel`` (model-dtype or FP8-per-tensor caches; one program per token),
``kv_write_per_token_head_kernel`` (int8 / e4m3 codes plus one fp32 scale per kv head; one
program per few tokens) and ``kv_write_int4_kernel`` (``int4_per_token_head``: rotated, MSE-clipped
int4). ``k8v4_per_token_head`` takes the int8 program for k (``SPLIT_K``) and the int4 one for v.

The host side (checks, which division aten uses, the launch) is ``attention/kernels/kv_write.py``
(``write_kv_triton``) and ``attention/kernels/kv_write_per_token_head.py``
(``write_kv_per_token_head``); ``kernels/launch.triton_program`` imports this module on first use.
Imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_kvq.attention.triton.hadamard import walsh_hadamard
from torch_kvq.attention.triton.helpers import INTERPRET, v_offsets

_TWO_23 = tl.constexpr(8388608.0)  # 2^23 (0f4B000000): fp32's ulp is 1 in [2^23, 2^24)
_TWO_23_HALF = tl.constexpr(12582912.0)  # 1.5 * 2^23: y + it rounds y to an integer, ties to even


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
def _divide_rows(x, s):
    """``x / s[:, None]`` correctly rounded, as aten's tensor division. Compiled: one reciprocal
    per row, ``r = 1 / s`` (correctly rounded), then per element ``y0 = x * r``, the residual
    negated, ``n = y0 * s - x`` (exact, by one fma), and ``y0 - n * r`` by one more fma
    (Markstein: correctly rounded when r is and no intermediate underflows). Negated so that
    -0 keeps its sign (``y0 = -0``, ``n = +0``: ``-0 + -0``), which e4m3 writes as its own
    byte; the residual ``x - y0 * s`` would give ``-0 + +0 = +0``. Only where fp32 underflows
    (|x| < 2^-100, or a subnormal quotient) may the quotient differ, and there (the scale is at
    least 1e-6) every int8 and e4m3 code is zero either way. The interpreter, whose fma rounds
    twice, divides directly."""
    if INTERPRET:
        return tl.math.div_rn(x, s[:, None])
    r = tl.math.div_rn(1.0, s)
    return tl.inline_asm_elementwise(  # in one asm block, so that ptxas folds the negations
        "{ .reg .f32 y0, n; mul.rn.f32 y0, $1, $3; neg.f32 n, $1; fma.rn.f32 n, y0, $2, n; "
        "neg.f32 n, n; fma.rn.f32 $0, n, $3, y0; }",
        "=f,f,f,f",
        [x, tl.broadcast_to(s[:, None], x.shape), tl.broadcast_to(r[:, None], x.shape)],
        dtype=tl.float32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _int8_codes(y, HALF_AWAY: tl.constexpr):
    """Quotients y (|y| <= 127 and a rounding, by construction) -> int8 codes, rounded exactly
    with no float-to-int conversion (a quarter-rate op): an fp32 in [2^23, 2^24) holds an integer
    n as 2^23 + n in its low mantissa bits. Half away from zero: ``b = 2^23 + floor(|y| +
    0.49999997)`` (an add rounded toward zero; ``floor(|y| + 0.5)`` would round 0.49999997 up), its
    low byte negated (``(b ^ m) - m``, m all ones) where y is negative. Half even, as
    torch.round: ``y + 1.5 * 2^23`` rounded to nearest even, whose low byte is the code in two's
    complement."""
    if HALF_AWAY:
        if INTERPRET:  # no PTX there; floor(a) + 2^23 is exact for 0 <= a < 2^23
            b = tl.floor(tl.abs(y) + 0.49999997) + _TWO_23
            m = y.to(tl.int32, bitcast=True) >> 31  # arithmetic: all ones where y is negative
            n = (b.to(tl.int32, bitcast=True) ^ m) - m
        else:
            n = tl.inline_asm_elementwise(
                "{ .reg .b32 a, m; abs.f32 a, $1; add.rn.f32 a, a, 0f3EFFFFFF; "
                "add.rz.f32 a, a, 0f4B000000; shr.s32 m, $1, 31; xor.b32 a, a, m; "
                "sub.s32 $0, a, m; }",
                "=r,r", [y], dtype=tl.int32, is_pure=True, pack=1,
            )  # fmt: skip
    else:
        n = (y + _TWO_23_HALF).to(tl.int32, bitcast=True)
    return n.to(tl.int8)  # the low byte


@triton.jit
def _quantize_heads(x, qmax_op, QMAX: tl.constexpr, FLOOR: tl.constexpr, DIVIDE: tl.constexpr,
                    INT8: tl.constexpr, HALF_AWAY: tl.constexpr):  # fmt: skip
    """Rows of x [BLOCK_H, BLOCK_D] (one kv head each; padding loaded as 0) -> (codes, scales
    [BLOCK_H] fp32) as ``quant.quantize_per_token_head`` computes them: ``absmax / QMAX`` as
    aten does (``DIVIDE``: correctly rounded by ``qmax_op``, else times ``qmax_op``, the
    reciprocal), ``x / scale`` correctly rounded (``_divide_rows``), int8 rounded exactly
    (``_int8_codes``; |x / scale| <= QMAX, so no clamp), e4m3 cast with round to nearest even and
    saturation (aten's clamp to +-QMAX: the same bytes)."""
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    if DIVIDE:
        s = tl.math.div_rn(amax, qmax_op)
    else:
        s = amax * qmax_op
    s = tl.maximum(s, FLOOR, propagate_nan=tl.PropagateNan.ALL)
    y = _divide_rows(x, s)
    if INT8:
        codes = _int8_codes(y, HALF_AWAY)
    else:
        if INTERPRET:  # numpy's cast does not saturate
            y = tl.clamp(y, -QMAX, QMAX, propagate_nan=tl.PropagateNan.ALL)
        codes = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return codes, s


@triton.jit
def kv_write_per_token_head_kernel(
    k_ptr, v_ptr, cache_ptr, scale_ptr, slot_ptr, qmax_op, n_tokens,
    k_st, k_sh, k_sd, v_st, v_sh, v_sd,
    c_sp, c_skv, c_ss, c_sh, c_sd, s_sp, s_skv, s_sh, s_ss,
    PAGE: tl.constexpr, KH: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QMAX: tl.constexpr, FLOOR: tl.constexpr,
    DIVIDE: tl.constexpr, INT8: tl.constexpr, HALF_AWAY: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Tokens ``[BLOCK_T * program_id, ...)`` (of ``n_tokens``): their k and v [KH, D], quantized
    per kv head (``_quantize_heads``; one row per (token, head), so that a program amortizes
    its scale math and reductions over several tokens): codes into ``cache[page, 0 / 1,
    offset]``, scales into ``scale[page, 0 / 1, :, offset]``. Any strides (``*_s*``: token /
    page, k-or-v, slot, head, dim); ``PAGE`` slots per page. ``SPLIT_K`` (``k8v4_per_token_head``'s
    k, int8): k only (v is the int4 program's), its codes as bytes with channel d in cache slot
    ``d // (D / 2)`` at ``d % (D / 2)``, offset binary (``quant.k8v4_k_slots``)."""
    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    token = tl.program_id(0).to(tl.int64) * BLOCK_T + rows // BLOCK_H  # [rows]
    h = rows % BLOCK_H
    row_ok = (token < n_tokens) & (h < KH)
    slot = tl.load(slot_ptr + token, mask=row_ok, other=0).to(tl.int64)
    page = slot // PAGE  # a constant divisor: a shift, or a multiply
    offset = slot - page * PAGE
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d[None, :] < D)
    k = tl.load(
        k_ptr + (token * k_st + h * k_sh)[:, None] + d[None, :] * k_sd, mask=mask, other=0.0
    )
    sdst = scale_ptr + page * s_sp + offset * s_ss + h * s_sh
    row = cache_ptr + (page * c_sp + offset * c_ss + h * c_sh)[:, None]
    kc, ks = _quantize_heads(k, qmax_op, QMAX, FLOOR, DIVIDE, INT8, HALF_AWAY)
    if SPLIT_K:
        half = (d % (D // 2)) * c_sd + (d // (D // 2)) * c_skv
        tl.store(row + half[None, :], kc.to(tl.uint8, bitcast=True) ^ 0x80, mask=mask)
        tl.store(sdst, ks, mask=row_ok)
    else:
        v = tl.load(
            v_ptr + (token * v_st + h * v_sh)[:, None] + d[None, :] * v_sd, mask=mask, other=0.0
        )
        vc, vs = _quantize_heads(v, qmax_op, QMAX, FLOOR, DIVIDE, INT8, HALF_AWAY)
        dst = row + d[None, :] * c_sd
        tl.store(dst, kc, mask=mask)
        tl.store(dst + c_skv, vc, mask=mask)
        tl.store(sdst, ks, mask=row_ok)
        tl.store(sdst + s_skv, vs, mask=row_ok)


# -- int4_per_token_head: rotate, MSE-clipped asymmetric int4, two codes per byte ---------------


@triton.jit
def _round_clamp15(y):
    """``clamp(round_half_away(y), 0, 15)`` exactly, for every fp32 y: ``clamp(floor(y +
    0.49999997), 0, 15)`` (0.49999997: fp32 0.5 - 2^-25; checked for every fp32 in [-1, 16.5]
    and beyond it on both sides nothing can differ: tests/attention/test_kv_write_int4.py)."""
    return tl.minimum(tl.maximum(tl.floor(y + 0.4999999701976776), 0.0), 15.0)


@triton.jit
def _int4_rotate(x, signs, R: tl.constexpr, BLOCK_D: tl.constexpr, LOG2B: tl.constexpr,
                 RSQRT_B: tl.constexpr):  # fmt: skip
    """Rows x [BLOCK_D, R] -> (rotated rows xf in fp32, each row's range lo0 <= 0 <= hi0 [R])."""
    xf = x.to(tl.float32) * signs[:, None]
    xf = walsh_hadamard(xf, BLOCK_D, R, LOG2B) * RSQRT_B
    return xf, tl.minimum(tl.min(xf, axis=0), 0.0), tl.maximum(tl.max(xf, axis=0), 0.0)


@triton.jit
def _int4_candidates(xf, lo, hi, N: tl.constexpr, RCP15: tl.constexpr, FLOOR: tl.constexpr):
    """Clipped ranges [lo, hi] [N] (a clip ratio times each row's range, or one row's range
    times every ratio) of rotated rows xf [BLOCK_D, N or 1] -> each candidate's (scale, 1 /
    scale, zero point, squared error in fp64) [N]. Padding channels: xf = 0, so code = zp and
    diff = 0: no mask needed."""
    scale = tl.maximum((hi - lo) * RCP15, FLOOR)
    scale = (scale.to(tl.int32, bitcast=True) & -16).to(tl.float32, bitcast=True)
    zp = _round_clamp15(tl.math.div_rn(-lo, scale))
    inv = tl.math.div_rn(tl.full([N], 1.0, tl.float32), scale)
    codes = _round_clamp15(xf * inv[None, :] + zp[None, :])
    diff = ((codes - zp[None, :]) * scale[None, :] - xf).to(tl.float64)
    return scale, inv, zp, tl.sum(diff * diff, axis=0)


@triton.jit
def _int4_rows(x, signs, ratio_ptr, R: tl.constexpr, BLOCK_D: tl.constexpr,
               LOG2B: tl.constexpr, RSQRT_B: tl.constexpr, RCP15: tl.constexpr,
               FLOOR: tl.constexpr, NUM_RATIOS: tl.constexpr):  # fmt: skip
    """Rows x [BLOCK_D, R] (channels first: one (token, kv head) a column, zero past D) ->
    (packed codes [BLOCK_D / 2, R] uint8, stored scales [R] fp32) as
    ``quant.quantize_int4_rotated``: every step the same fp32 operation (the launch turns off fma
    contraction), the clip errors in fp64. Padding channels stay zero through the rotation (D
    is a multiple of its block), leave min / max alone (the range holds zero anyway) and add
    exact zeros to the error sums."""
    xf, lo0, hi0 = _int4_rotate(x, signs, R, BLOCK_D, LOG2B, RSQRT_B)
    best = tl.full([R], float("inf"), tl.float64)
    best_scale = tl.zeros([R], tl.float32)
    best_inv = tl.zeros([R], tl.float32)
    best_zp = tl.zeros([R], tl.float32)
    for i in range(NUM_RATIOS):  # the clip ratios, largest first; the first kept on a tie
        ratio = tl.load(ratio_ptr + i)
        scale, inv, zp, err = _int4_candidates(xf, lo0 * ratio, hi0 * ratio, R, RCP15, FLOOR)
        better = (err < best) | (i == 0)
        best = tl.where(better, err, best)
        best_scale = tl.where(better, scale, best_scale)
        best_inv = tl.where(better, inv, best_inv)
        best_zp = tl.where(better, zp, best_zp)
    return _int4_pack(xf, best_scale, best_inv, best_zp, R, BLOCK_D)


@triton.jit
def _int4_pack(xf, scale, inv, zp, R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotated rows xf [BLOCK_D, R] and each row's chosen (scale, 1 / scale, zero point) [R] ->
    (packed codes [BLOCK_D / 2, R] uint8, stored scales [R] fp32, the zero point in the low
    bits)."""
    codes = _round_clamp15(xf * inv[None, :] + zp[None, :])
    codes = tl.permute(tl.reshape(codes, [BLOCK_D // 2, 2, R]), [0, 2, 1])
    even, odd = tl.split(codes)  # [BLOCK_D / 2, R] each
    packed = (even + odd * 16.0).to(tl.int32).to(tl.uint8)
    stored = scale.to(tl.int32, bitcast=True) | zp.to(tl.int32)
    return packed, stored.to(tl.float32, bitcast=True)


@triton.jit
def _int4_row(x, signs, ratio_ptr, BLOCK_D: tl.constexpr, LOG2B: tl.constexpr,
              RSQRT_B: tl.constexpr, RCP15: tl.constexpr, FLOOR: tl.constexpr,
              NUM_RATIOS: tl.constexpr, RATIOS_PAD: tl.constexpr):  # fmt: skip
    """``_int4_rows`` for one row x [BLOCK_D, 1] with every clip ratio at once: the candidates
    are the tile's second axis, [BLOCK_D, RATIOS_PAD], so their error sums run side by side
    rather than one after another (a decode step's write is a few rows a program: its latency is
    the chain of the ratios' reductions). The same fp32 operations per candidate as
    ``_int4_rows`` (``_int4_candidates``); the first ratio of least error kept (padding ratios:
    an infinite error)."""
    xf, lo0, hi0 = _int4_rotate(x, signs, 1, BLOCK_D, LOG2B, RSQRT_B)  # lo0, hi0: [1]
    i = tl.arange(0, RATIOS_PAD)
    ratio = tl.load(ratio_ptr + i, mask=i < NUM_RATIOS, other=1.0)
    scale, inv, zp, err = _int4_candidates(xf, lo0 * ratio, hi0 * ratio, RATIOS_PAD, RCP15, FLOOR)
    err = tl.where(i < NUM_RATIOS, err, float("inf"))
    first = tl.min(tl.where(err == tl.min(err, axis=0), i, RATIOS_PAD), axis=0)
    pick = i == first
    one = tl.zeros([1], tl.float32)
    best_scale = one + tl.sum(tl.where(pick, scale, 0.0), axis=0)  # exact: one term is nonzero
    best_inv = one + tl.sum(tl.where(pick, inv, 0.0), axis=0)
    best_zp = one + tl.sum(tl.where(pick, zp, 0.0), axis=0)
    return _int4_pack(xf, best_scale, best_inv, best_zp, 1, BLOCK_D)


@triton.jit(do_not_specialize=["k_sd", "v_sd"])
def kv_write_int4_kernel(
    k_ptr, v_ptr, cache_ptr, scale_ptr, slot_ptr, sign_ptr, ratio_ptr, n_rows,
    k_st, k_sh, k_sd, v_st, v_sh, v_sd,
    c_sp, c_skv, c_ss, c_sh, c_sd, s_sp, s_skv, s_sh, s_ss, page_size,
    KH: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    LOG2B: tl.constexpr, RSQRT_B: tl.constexpr, RCP15: tl.constexpr, FLOOR: tl.constexpr,
    NUM_RATIOS: tl.constexpr, ROWS_FIRST: tl.constexpr, V_SIDE: tl.constexpr,
    RATIOS_PAD: tl.constexpr,
):  # fmt: skip
    """Rows ``[BLOCK_R * program_id(0), ...)`` of the ``n_rows`` = T * KH (token, kv head) rows
    of k (``program_id(1)`` 0) or of v (1), each quantized by ``_int4_rows`` (``_int4_row``
    when ``ROWS_FIRST``): packed codes into ``cache[page, 0 / 1, offset, head]`` (D / 2 bytes),
    stored scales into ``scale[page, 0 / 1, head, offset]``; side ``V_SIDE``'s codes (v's) at
    their own positions (``helpers.v_offsets``). ``sign_ptr``: the rotation's signs [D] fp32;
    ``ratio_ptr``: the clip ratios [NUM_RATIOS] fp32. Any strides (``*_s*``: token / page,
    k-or-v, slot, head, dim).

    The tiles are channels first, [BLOCK_D, BLOCK_R], and k / v's channel strides are not
    specialized (so not known to be 1): Triton then lays a tile out with the rows across the
    threads and each row's channels in one thread's registers, so the butterfly, min / max, the
    error sums and the per-row scale math need no shuffles and run once per row (sm90 SASS,
    offline: about 170 instructions per value of k or v, 1 warp, D 64-256; a row-major tile
    spread each row over the lanes and repeated the per-row math in every thread, about 870).
    D = 256 spills (a row is 256 fp32 registers). ``ROWS_FIRST`` (a batch too small to give
    every SM a program that way, a decode step's): the tile is loaded rows first, one row's
    channels across the lanes, and transposed: more instructions per value, many more programs
    at once, so a few tokens are written in a few microseconds rather than one thread's whole
    serial row of work; its clip ratios side by side (``_int4_row``, a tile RATIOS_PAD =
    NUM_RATIOS to a power of two wide), not in turn: a decode step's write is latency-bound."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    kv = tl.program_id(1)
    row_ok = row < n_rows
    token = row // KH
    h = row - token * KH
    slot = tl.load(slot_ptr + token, mask=row_ok, other=0).to(tl.int64)
    page = slot // page_size
    offset = slot - page * page_size
    d = tl.arange(0, BLOCK_D)
    signs = tl.load(sign_ptr + d, mask=d < D, other=0.0)
    if kv == 0:
        src = k_ptr + token * k_st + h * k_sh
        sd = k_sd
    else:
        src = v_ptr + token * v_st + h * v_sh
        sd = v_sd
    if ROWS_FIRST:
        x = tl.load(src[:, None] + d[None, :] * sd, mask=row_ok[:, None] & (d[None, :] < D),
                    other=0.0)  # fmt: skip
        x = tl.trans(x)
    else:
        x = tl.load(src[None, :] + d[:, None] * sd, mask=(d[:, None] < D) & row_ok[None, :],
                    other=0.0)  # fmt: skip
    if ROWS_FIRST:
        codes, stored = _int4_row(x, signs, ratio_ptr, BLOCK_D, LOG2B, RSQRT_B, RCP15, FLOOR,
                                  NUM_RATIOS, RATIOS_PAD)  # fmt: skip
    else:
        codes, stored = _int4_rows(x, signs, ratio_ptr, BLOCK_R, BLOCK_D, LOG2B, RSQRT_B, RCP15,
                                   FLOOR, NUM_RATIOS)  # fmt: skip
    j = tl.arange(0, BLOCK_D // 2)
    head = cache_ptr + kv * c_skv + (page * c_sp + h * c_sh)[None, :]
    tok, col = v_offsets(offset, j, kv == V_SIDE, page_size, c_ss, c_sd, D // 2)
    dst = head + tok[None, :] + col[:, None]
    tl.store(dst, codes, mask=(j[:, None] < D // 2) & row_ok[None, :])
    tl.store(scale_ptr + kv * s_skv + page * s_sp + offset * s_ss + h * s_sh, stored, mask=row_ok)
