"""Device code of the TMA decode over an ``int4_per_token_head`` cache, read in place
(``decode_tma`` and ``decode_balanced`` call it where ``INT4``).

The cache (``quant``'s "4-bit per (token, head)" section): packed codes [P, 2, page, KH, D / 2]
uint8, the even channel of each pair in the low nibble; ``kv_scale`` [P, 2, KH, page] fp32 whose 4
low mantissa bits hold the zero point zp; value = (code - zp) * scale (scale: those bits
cleared), in the rotated basis ``R = H_b diag(signs) / sqrt(b)`` (b = ``hadamard_block(D)``).
Attention in the model's basis needs no per-key pass: ``q . k = (R q) . (R k)`` and
``sum_n p_n v_n = R^T sum_n p_n (R v_n)``. So per program:

- prologue (``rotate_q``): ``R q`` as its even-channel and odd-channel halves [BLOCK_G, D / 2]
  (the nibbles' channels): the signs and the Walsh-Hadamard butterfly in fp32 on a loaded tile,
  times fp32 ``b ** -0.5`` (the odd half also times 1 / 16: ``q_odd' = q_odd / 16``), rounded
  once to the dot dtype; and ``sum(q)`` of each half as [BLOCK_G, PAGE] products with ones, so
  that they sit in the logits' layout;
- per page (``page_int4``, in ``k8v4.attend_packed``'s loop): one TMA box [page, D / 2] of bytes
  each for K and V, and one [2, page] of their scales (``page_scales``); the nibbles go to fp16
  by the exponent trick with no arithmetic (``unpack``:
  ``(byte & 0xF) | 0x6400`` as fp16 is ``1024 + code``, ``(byte & 0xF0) | 0x6400`` is ``1024 +
  16 * code``; compiled, two byte permutes and four ``lop3`` per eight codes); the offsets and
  the zero points come out per row and column instead of per element: logits ``q_even . k_lo +
  q_odd' . k_hi`` (two MMA chains, one per half, each started at minus ``512 * (sum q_even + sum
  q_odd')``, summed) minus ``zp * (sum q_even + 16 sum q_odd')`` (the sums of the fp16
  operands), times the token's k scale (the offsets cost a logit's fp32 sum of D / 2 products
  some 10 bits, far below the fp16 operands' rounding); V's nibbles are centred per element
  before ``p @ v`` (``unpack_centred``: minus ``1024 + zp``, ``1024 + 16 zp`` in fp16, exact),
  not afterwards: taken out of the fp32 sum over thousands of tokens the offsets cancel against
  an output that can be some 1e-4 of them (random v at 16k: 0.22 relative error on the H200,
  where the products' fp32 accumulation is not exact); ``p @ v`` into two accumulators (even,
  odd channels; the odd one divided by 16 at the end), the weights times the v scales and
  ``PV_SCALE`` as the 8-bit caches do; the weights' sums elementwise per token slot (``l_acc``,
  summed across the slots after the loop);
- epilogue (``unrotate_store``): the normalised halves (``PV_SCALE`` divided out) scaled per row
  by a power of two to a maximum in [1, 2), rounded once to fp16 (fp32 with fp32 products), and
  ``R^T`` applied by +-1 products against ``U`` [D, D] (rows: the halves' columns, V's column
  permutation and the even / odd interleave absorbed), fp32 accumulate, in column chunks of 16.
  Each split's partial output is un-rotated before it is stored: the log-sum-exp merge is linear
  in the outputs, so the merged output is the same.

The epilogue's +-1 matrix and the signs (``rotation_matrices``: [D * D + D] fp16) are built on
the host once per (D, device) and read by each program from L2.
Imports Triton: import only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from torch_kvq.attention.rotation import hadamard_block, hadamard_signs, walsh_hadamard
from torch_kvq.attention.triton.hadamard import hadamard_stage
from torch_kvq.attention.triton.helpers import _LOG2E, INTERPRET

# output columns per chunk of the epilogue's un-rotation (and q rows per prologue chunk); a jit
# function reads only constexpr globals (Triton 3.6)
NC = tl.constexpr(16)


def v_columns(d: int) -> torch.Tensor:
    """Byte column of V held by each column of ``page_int4``'s permuted V tile [page, D / 2]:
    column ``c`` holds byte ``(c % 8) * (D / 16) + c // 8`` (so each lane's mma B fragment, the
    8-column blocks' column ``l // 4``, is one contiguous run of D / 16 bytes of a row)."""
    w = d // 2
    c = torch.arange(w)
    return (c % 8) * (w // 8) + c // 8


_OPERANDS: dict[tuple[int, torch.device], torch.Tensor] = {}


def rotation_matrices(d: int, device: torch.device) -> torch.Tensor:
    """[D * D + D] fp16 (cached per (D, device)): U [D, D] +-1, ``R^T y * sqrt(b) = u @ U`` for
    ``u`` = (y's even channels, odd channels), each half in ``v_columns`` order; then the
    rotation's signs [D] (``rotate_q``'s)."""
    key = (d, torch.device(device))
    if key not in _OPERANDS:
        b = hadamard_block(d)
        signs = hadamard_signs(d)
        a = walsh_hadamard(torch.eye(d), b) * signs  # row j: s * H e_j, the coefficients of y_j
        perm = v_columns(d)
        u = torch.cat((a[2 * perm], a[2 * perm + 1]), 0)
        _OPERANDS[key] = torch.cat((u.flatten(), signs)).to(torch.float16).to(device).contiguous()
    return _OPERANDS[key]


@triton.jit
def rotate_q(
    q_ptr, b, heads, g_mask, stride_qb, stride_qh, rot_ptr,
    BLOCK_G: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr, RSQRT_B: tl.constexpr,
):  # fmt: skip
    """``R q`` of ``heads`` (masked by ``g_mask``) of sequence ``b`` as (even channels, odd
    channels / 16) [BLOCK_G, D / 2] in ``DOT`` (the 16th matches ``unpack``'s 16 times the high
    nibble, so both halves' logits sum in one MMA chain): the signs (``rot_ptr``'s last D) and
    the butterfly (``hadamard.walsh_hadamard``, fp32, D a power of two: one block) on a
    channels-first tile, times ``RSQRT_B`` (and 1 / 16) in fp32, one rounding to ``DOT``. The
    tile comes from a load, not from an MMA: the page loop then reads q as a dot operand from
    shared memory (as the 8-bit caches' loop does) instead of converting an MMA result's layout
    on every page."""
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + heads[None, :] * stride_qh + d[:, None],
                mask=g_mask[None, :], other=0.0)  # fmt: skip
    signs = tl.load(rot_ptr + D * D + d).to(tl.float32)
    y = q.to(tl.float32) * signs[:, None]
    for s in tl.static_range(12):  # stages H = 1, 2, .., D / 2 (D <= 4096)
        if (1 << s) < D:
            y = hadamard_stage(y, D, BLOCK_G, 1 << s)
    y = tl.permute(tl.reshape(y * RSQRT_B, [D // 2, 2, BLOCK_G]), [2, 0, 1])
    q_lo, q_hi = tl.split(y)  # [BLOCK_G, D / 2] each
    return q_lo.to(DOT), (q_hi * 0.0625).to(DOT)


@triton.jit
def unpack(x, DOT: tl.constexpr):
    """Packed bytes ``x`` (uint8) -> (low nibble + A, 16 * high nibble + A) in ``DOT``, exactly,
    with A = ``offset(DOT)``: fp16 by the exponent trick, ``(byte & 0xF) | 0x6400`` as fp16 is
    ``1024 + code`` and ``(byte & 0xF0) | 0x6400`` is ``1024 + 16 * code`` (compiled: two byte
    permutes and four ``lop3`` per eight codes, ``_unpack_fp16``; the interpreter, which runs no
    PTX, takes the same steps value by value); other dot dtypes convert the integers (A = 0).
    K's offsets and zero points are taken out per logit afterwards (``page_int4``)."""
    if DOT == tl.float16:
        if INTERPRET:
            lo = ((x & 0xF).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
            hi = ((x & 0xF0).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
            return lo, hi
        return _unpack_fp16(x)
    return (x & 0xF).to(DOT), (x & 0xF0).to(DOT)


@triton.jit
def offset(DOT: tl.constexpr):
    """What ``unpack`` adds to every code in ``DOT``: 1024 in fp16, else 0."""
    if DOT == tl.float16:
        return 1024.0
    return 0.0


@triton.jit
def _unpack_fp16(x):
    """Four bytes in, their eight codes out under fp16's exponent of 1024, two per register:
    bytes 0, 1 and 2, 3 spread to 16-bit lanes (``prmt``), then ``(t & 0x000F000F) | 0x64006400``
    (low nibbles: 1024 + code) and ``(t & 0x00F000F0) | 0x64006400`` (high: 1024 + 16 code), one
    ``lop3`` each."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t0, t1; "
        "prmt.b32 t0, $4, 0, 0x4140; prmt.b32 t1, $4, 0, 0x4342; "
        "lop3.b32 $0, t0, 0x000f000f, 0x64006400, 0xea; "
        "lop3.b32 $1, t1, 0x000f000f, 0x64006400, 0xea; "
        "lop3.b32 $2, t0, 0x00f000f0, 0x64006400, 0xea; "
        "lop3.b32 $3, t1, 0x00f000f0, 0x64006400, 0xea; }",
        "=r,=r,=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def unpack_centred(x, zp, DOT: tl.constexpr):
    """Packed bytes ``x`` (uint8) with zero points ``zp`` (int32, 0..15, broadcastable to x) ->
    (low nibble - zp, 16 * (high nibble - zp)) in ``DOT``, exactly: ``unpack``'s fp16 forms minus
    ``1024 + zp`` and ``1024 + 16 zp`` (``sub.f16x2``, exact: integers below 2048); those two are
    fp16 bit patterns made as ``unpack``'s are (``0x6400 | zp``, ``0x6400 | zp << 4``: no
    conversion). For V: the offset taken out per element, before the products, not from their
    fp32 sum (``pv``)."""
    if DOT == tl.float16:
        z_lo = tl.broadcast_to((zp | 0x6400).to(tl.int16).to(tl.float16, bitcast=True), x.shape)
        z_hi = tl.broadcast_to(
            ((zp << 4) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True), x.shape
        )
        return unpack_minus(x, z_lo, z_hi)
    lo, hi = unpack(x, DOT)
    return lo - zp.to(DOT), hi - (zp * 16).to(DOT)


@triton.jit
def unpack_minus(x, z_lo, z_hi):
    """Packed bytes ``x`` -> ``unpack``'s fp16 forms minus ``z_lo`` (low nibbles) and ``z_hi``
    (high), fp16 [x.shape] each (``unpack_centred``'s step, the two nibbles' zero points apart;
    tc4's form, with its fifth bits: ``decode_tc4_tma.unpack5_minus``)."""
    if INTERPRET:
        lo, hi = unpack(x, tl.float16)
        return lo - z_lo, hi - z_hi
    return _unpack_centred_fp16(x, z_lo, z_hi)


@triton.jit
def _unpack_centred_fp16(x, z_lo, z_hi):
    """``_unpack_fp16`` then minus ``z_lo`` (low nibbles) and ``z_hi`` (high), two at a time."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t0, t1, u; "
        "prmt.b32 t0, $4, 0, 0x4140; prmt.b32 t1, $4, 0, 0x4342; "
        "lop3.b32 u, t0, 0x000f000f, 0x64006400, 0xea; sub.rn.f16x2 $0, u, $5; "
        "lop3.b32 u, t1, 0x000f000f, 0x64006400, 0xea; sub.rn.f16x2 $1, u, $6; "
        "lop3.b32 u, t0, 0x00f000f0, 0x64006400, 0xea; sub.rn.f16x2 $2, u, $7; "
        "lop3.b32 u, t1, 0x00f000f0, 0x64006400, 0xea; sub.rn.f16x2 $3, u, $8; }",
        "=r,=r,=r,=r,r,r,r,r,r", [x, z_lo, z_hi], dtype=(tl.float16, tl.float16), is_pure=True,
        pack=4,
    )  # fmt: skip


@triton.jit
def _split_scale(stored):
    """Stored int4 scales (fp32) -> (the scale, low 4 bits cleared; the zero point, int32)."""
    bits = stored.to(tl.int32, bitcast=True)
    return (bits & -16).to(tl.float32, bitcast=True), bits & 0xF


def scale_descriptor(kv_scale: torch.Tensor, heads: int = 1) -> TensorDescriptor:
    """A 4-bit cache's scales [P, 2, KH, page] fp32 as a TMA descriptor over [P, 2, KH * page]
    with box [1, 2, heads * page]: one page's k and v scales of ``heads`` neighbouring kv heads
    in one copy (``page_scales``), in flight with the page's codes, instead of two gathers with
    their own waits."""
    pages, two, kh, page = kv_scale.shape
    rows = kv_scale.view(pages, two, kh * page)
    box = [1, 2, heads * page]
    return TensorDescriptor(rows, list(rows.shape), [two * kh * page, kh * page, 1], box)


@triton.jit
def v_tile(v, PAGE: tl.constexpr, W: tl.constexpr):
    """A page's 4-bit V codes as the cache lays them (``v_layout``) -> [PAGE, W], a token a row,
    the columns in ``v_columns`` order. No data moves: where the layout applies (PAGE a multiple
    of 16, W of 32) the labels make ``pv``'s operand (its transpose) hold in each register one
    32-bit word of the tile (four consecutive tokens of one column) and each lane's four words of
    a 16-token step 16 contiguous bytes, the eight lanes of a load phase on distinct banks."""
    if PAGE % 16 == 0 and W % 32 == 0:
        v = tl.reshape(v, [PAGE // 16, W // 32, 8, 4, 4, 4])  # s, h, g, t, w, j
        v = tl.permute(v, [1, 4, 2, 0, 3, 5])  # column 32h + 8w + g, token 16s + 4t + j
        return tl.trans(tl.reshape(v, [W, PAGE]))
    else:
        return tl.reshape(tl.permute(tl.reshape(v, [PAGE, 8, W // 8]), [0, 2, 1]), [PAGE, W])


@triton.jit
def page_scales(scale_desc, page, kh, PAGE: tl.constexpr):
    """Page ``page``'s stored k and v scales [PAGE] each of kv head ``kh`` (``scale_descriptor``)."""
    sc = tl.reshape(scale_desc.load([page, 0, kh * PAGE]), [2, PAGE])
    return tl.split(tl.permute(sc, [1, 0]))


@triton.jit
def page_int4(
    q_lo, q_hi, q_base, q_sum, kv_desc, table, p, p_end, col, lo, seq_len, qk_scale_log2, soft_cap,
    offs_t, scale_desc, kh, PAGE: tl.constexpr, W: tl.constexpr, DOT: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, PV_SCALE: tl.constexpr,
):  # fmt: skip
    """``helpers.page_logits`` for the int4 cache: page ``p`` of the run (past ``p_end``: logits
    -inf, page 0 read), one box [PAGE, W = D / 2] of bytes each for K and V. Returns its base-2
    logits transposed, [PAGE, BLOCK_G] (the tokens on the MMA's M dimension, the heads on its N:
    a GQA group of up to 8 heads fills the N of 8 rather than padding an M of 16), its V bytes
    with the columns in ``v_columns`` order, their zero points [PAGE] (int32) and v scales times
    ``PV_SCALE`` [PAGE] (0 where masked). ``unpack``'s offsets and the zero points leave the
    logits per row and column (``q_hi`` is ``rotate_q``'s, a 16th of the odd channels):
    ``q_base`` [PAGE, BLOCK_G], where each half's MMA chain starts, is ``-A * (sum(q_lo) +
    sum(q_hi)) / 2``, ``q_sum`` ``sum(q_lo) + 16 * sum(q_hi)`` (per head, in the logits'
    layout)."""
    ok = p < p_end
    page = tl.load(table + p, mask=ok, other=0)
    row = page * (2 * PAGE)
    k = kv_desc.load([row, col])  # [PAGE, W] uint8
    v = v_tile(kv_desc.load([row + PAGE, col]), PAGE, W)
    k_stored, v_stored = page_scales(scale_desc, page, kh, PAGE)
    k_scale, k_zp = _split_scale(k_stored)
    v_scale, v_zp = _split_scale(v_stored)
    k_lo, k_hi = unpack(k, DOT)  # codes + A, 16 * codes + A
    # two MMA chains, each started at q_base (half the offset term), summed: half the
    # dependent steps of one chain through both halves (a warp waits on its own chain)
    s = tl.dot(k_lo, tl.trans(q_lo), q_base) + tl.dot(k_hi, tl.trans(q_hi), q_base)
    s = s - q_sum * k_zp.to(tl.float32)[:, None]  # sum_d q_d (code_d - zp)
    toks = p * PAGE + offs_t
    live = (toks >= lo) & (toks < seq_len) & ok
    s = s * (k_scale * qk_scale_log2)[:, None]
    if USE_SOFT_CAP:  # cap * tanh(x / cap), tanh(y) = 1 - 2 / (exp(2y) + 1)
        s = s / _LOG2E
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0)) * _LOG2E
    v_scales = tl.where(live, v_scale * PV_SCALE, 0.0)
    return tl.where(live[:, None], s, float("-inf")), v, v_zp, v_scales


@triton.jit
def pv(acc_lo, acc_hi, pr, v, v_zp, v_scales, DOT: tl.constexpr):
    """``acc += (v - zp)^T @ w`` for both halves of V's bytes ``v`` (the high one 16 times the
    code), ``w = pr * v_scales`` [PAGE, BLOCK_G] in ``DOT``; acc [D / 2, BLOCK_G]."""
    return pv_weighted(acc_lo, acc_hi, (pr * v_scales[:, None]).to(DOT), v, v_zp, DOT)


@triton.jit
def pv_weighted(acc_lo, acc_hi, w, v, v_zp, DOT: tl.constexpr):
    """``pv`` with its operand ``w`` [PAGE, BLOCK_G] (``DOT``) given."""
    v_lo, v_hi = unpack_centred(v, v_zp[:, None], DOT)
    return tl.dot(tl.trans(v_lo), w, acc_lo), tl.dot(tl.trans(v_hi), w, acc_hi)


@triton.jit
def rescale(acc_lo, acc_hi, l_acc, m_i, m_blk):
    """The online softmax's update for a block's max ``m_blk`` [BLOCK_G] over the transposed
    accumulators [D / 2, BLOCK_G] and the weights' running sums ``l_acc`` [PAGE, BLOCK_G] (per
    token slot, summed over the slots once, after the loop): (acc_lo, acc_hi, l_acc, the new
    max, the max the block's weights are taken against). The lazy rescale
    (``k8v4.attend_packed``) calls it only when the reference max moves."""
    m_new = tl.maximum(m_i, m_blk)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    acc_lo = acc_lo * alpha[None, :]
    acc_hi = acc_hi * alpha[None, :]
    l_acc = l_acc * alpha[None, :]
    return acc_lo, acc_hi, l_acc, m_new, m_safe


@triton.jit
def unrotate_store(
    acc_lo, acc_hi, l_i, out_scale, rot_ptr, dst0, mask0, dst1, mask1,
    D: tl.constexpr, DOT: tl.constexpr, RSQRT_B: tl.constexpr, TWO: tl.constexpr,
):  # fmt: skip
    """The normalised output ``R^T (acc / l_i * out_scale)`` [BLOCK_G, D] (head dims in order) at
    rows ``dst0`` [BLOCK_G] (pointers to each row's first element) where ``mask0``, and (``TWO``)
    at ``dst1`` where ``mask1``. Rows with ``l_i == 0`` give 0. Each row is scaled by a power of
    two to a maximum in [1, 2) before its one rounding to fp16 (fp32 where ``DOT`` is), so the
    rounding is 2^-12 of the row's maximum at any magnitude; products against U fp32-accumulated."""
    f = out_scale / tl.where(l_i == 0.0, 1.0, l_i)
    y_lo = acc_lo * f[:, None]
    y_hi = acc_hi * f[:, None]
    top = tl.maximum(tl.max(tl.abs(y_lo), axis=1), tl.max(tl.abs(y_hi), axis=1))
    e = tl.floor(tl.log2(tl.where(top > 0.0, top, 1.0)))
    y_lo = y_lo * tl.exp2(-e)[:, None]
    y_hi = y_hi * tl.exp2(-e)[:, None]
    if DOT == tl.float32:
        u_lo = y_lo
        u_hi = y_hi
    else:  # fp16 for bf16 products too: 2^-12, not bf16's 2^-9
        u_lo = y_lo.to(tl.float16)
        u_hi = y_hi.to(tl.float16)
    back = (tl.exp2(e) * RSQRT_B)[:, None]
    offs_w = tl.arange(0, D // 2)
    offs_n = tl.arange(0, NC)
    for c in tl.static_range(D // NC):
        cols = (offs_n + c * NC)[None, :]  # (tensor first: constexpr + tensor is no tensor)
        u = rot_ptr + offs_w[:, None] * D + cols
        u_odd = tl.load(u + (D // 2) * D).to(u_hi.dtype)
        o = tl.dot(u_hi, u_odd, tl.dot(u_lo, tl.load(u).to(u_lo.dtype))) * back
        tl.store(dst0[:, None] + cols, o.to(dst0.dtype.element_ty), mask=mask0[:, None])
        if TWO:
            tl.store(dst1[:, None] + cols, o.to(dst1.dtype.element_ty), mask=mask1[:, None])


@triton.jit
def store_lse(m_i, l_i, ptrs, mask):
    """A partial's log-sum-exp (base 2; -inf for an empty part) at ``ptrs`` where ``mask``."""
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    tl.store(ptrs, lse, mask=mask)


@triton.jit
def store_split_int4(
    acc_lo, acc_hi, m_i, l_i, b, split, heads, g_mask, out_ptr, part_o_ptr, part_lse_ptr,
    out_scale, rot_ptr, stride_ob, stride_oh, QH: tl.constexpr, D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DIRECT: tl.constexpr, DOT: tl.constexpr, RSQRT_B: tl.constexpr,
):  # fmt: skip
    """``helpers.store_split`` for the int4 accumulators: the output (``DIRECT``) or the split's
    partial output, both un-rotated and with ``out_scale`` applied, and its log-sum-exp."""
    if DIRECT:
        dst = out_ptr + b * stride_ob + heads * stride_oh
        unrotate_store(acc_lo, acc_hi, l_i, out_scale, rot_ptr, dst, g_mask, dst, g_mask,
                       D, DOT, RSQRT_B, False)  # fmt: skip
    else:
        rows = (b.to(tl.int64) * QH + heads) * NUM_SPLITS + split  # [B, QH, S] row
        store_lse(m_i, l_i, part_lse_ptr + rows, g_mask)
        dst = part_o_ptr + rows * D
        unrotate_store(acc_lo, acc_hi, l_i, out_scale, rot_ptr, dst, g_mask, dst, g_mask,
                       D, DOT, RSQRT_B, False)  # fmt: skip


def int4_pv_shift(dot_dtype: torch.dtype, lazy: bool) -> int:
    """``decode_tma.pv_shift`` for int4 codes: ``v_scale = (hi - lo) / 15`` is between
    absmax / 30 (MSE clip 0.5) and absmax / 7.5 of the head's rotated values, some 16 times the
    int8 scale (absmax / 127), so the shift is the int8 one less 4: 0 lazy, 4 eager. Then
    ``p * v_scale * 2^shift`` stays below 65504 for rotated |v| up to about 1900 lazy (weights up
    to 2^8) and 30000 eager (weights up to 1), and normal in fp16 for a rotated absmax above
    about 2e-3 lazy, 1.2e-4 eager. (The rotated values are bounded by the head's L2 norm.) A
    larger |v| overflows to inf (the output NaN, never clipped); bf16 / fp32 products: none."""
    if dot_dtype != torch.float16:
        return 0
    return 0 if lazy else 4
