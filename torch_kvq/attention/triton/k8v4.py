"""Device code of the TMA decode over a ``k8v4_per_token_head`` cache, read in place
(``decode_tma`` and ``decode_balanced`` call it where ``K8V4``), and the page loop of both 4-bit
caches (``attend_packed``: int4's pages or k8v4's, one loop).

The cache (``quant``'s k8v4 section): uint8 [P, 3, page, KH, D / 2], slots 0 and 1 k's int8
codes as offset-binary bytes (``code + 128``; channels 0..D/2-1 and D/2..D-1), slot 2 v's packed
int4 codes (rotated, asymmetric, two per byte); ``kv_scale`` [P, 2, KH, page] fp32: k's int8
scale, v's int4 scale with the zero point in its 4 low mantissa bits. K is read as the int8
cache is (``helpers.page_logits``), V as the int4 one (``int4.page_int4``). Per program:

- prologue (``q_halves``): q is not rotated (k is not): its two halves [BLOCK_G, D / 2], the
  channels of slots 0 and 1, in the dot dtype;
- per page (``page_k8v4``): three TMA boxes [page, D / 2] of bytes (k's halves, v) and one of
  the page's scales (``int4.page_scales``); the logits ``q_lo . k0 + q_hi . k1`` (the offset-binary
  bytes widened exactly under an offset, ``helpers.widen_biased``: the offset times
  sum(q), from the prologue, leaves each logit once rather than each code), times the token's k
  scale and the logit scale; V's bytes in ``int4.v_columns`` order, centred
  per element (``int4.unpack_centred``: ``code - zp`` exact in fp16, before the products; the
  int4 module's docstring says why not after), ``p @ v`` into two accumulators (even and odd
  rotated channels) with the weights times the v scales and ``PV_SCALE``
  (``int4.int4_pv_shift``: V's codes are int4's); the heads on the MMA's N dimension, as int4's
  loop (``int4.pv``, ``int4.rescale``: logits [page, heads], accumulators [D / 2, heads]);
- epilogue (``int4.unrotate_store``): the output un-rotated by U (``int4.rotation_matrices``'
  matrix; its signs, q's rotation, are not read).

Imports Triton: import only where Triton is installed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_kvq.attention.triton.helpers import _LOG2E, int8_offset, load_q, widen_biased
from torch_kvq.attention.triton.int4 import (
    _split_scale,
    offset,
    page_int4,
    page_scales,
    pv,
    rescale,
    rotate_q,
    v_tile,
)


@triton.jit
def q_halves(q_ptr, b, heads, g_mask, stride_qb, stride_qh, D: tl.constexpr, DOT: tl.constexpr):
    """The query rows of ``heads`` (masked by ``g_mask``) of sequence ``b`` as their halves
    (channels 0..D/2-1, D/2..D-1) [BLOCK_G, D / 2] in ``DOT``: k's slots 0 and 1."""
    offs = tl.arange(0, D // 2)
    q_lo = load_q(q_ptr, b, heads, g_mask, offs, stride_qb, stride_qh, DOT)
    q_hi = load_q(q_ptr + D // 2, b, heads, g_mask, offs, stride_qb, stride_qh, DOT)
    return q_lo, q_hi


@triton.jit
def page_k8v4(
    q_lo, q_hi, q_base, kv_desc, table, p, p_end, col, lo, seq_len, qk_scale_log2, soft_cap, offs_t,
    scale_desc, kh, PAGE: tl.constexpr, W: tl.constexpr, DOT: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, PV_SCALE: tl.constexpr,
):  # fmt: skip
    """``helpers.page_logits`` for the k8v4 cache: page ``p`` of the run (past ``p_end``: logits
    -inf, page 0 read), boxes [PAGE, W = D / 2] of bytes at rows ``3 * PAGE * page`` (k's slot
    0), ``+ PAGE`` (slot 1), ``+ 2 * PAGE`` (v). Returns its base-2 logits transposed, [PAGE,
    BLOCK_G] (the heads on the MMA's N dimension, as ``int4.page_int4``), its V bytes with the
    columns in ``v_columns`` order, their zero points [PAGE] (int32) and v scales times
    ``PV_SCALE`` [PAGE] (0 where masked)."""
    ok = p < p_end
    page = tl.load(table + p, mask=ok, other=0)
    row = page * (3 * PAGE)
    k0 = kv_desc.load([row, col])  # [PAGE, W] offset-binary bytes
    k1 = kv_desc.load([row + PAGE, col])
    v = v_tile(kv_desc.load([row + 2 * PAGE, col]), PAGE, W)
    k_scale, v_stored = page_scales(scale_desc, page, kh, PAGE)
    v_scale, v_zp = _split_scale(v_stored)
    # two MMA chains (as int4's), each started at q_base: half the offset term
    s = (tl.dot(widen_biased(k0, DOT), tl.trans(q_lo), q_base)
         + tl.dot(widen_biased(k1, DOT), tl.trans(q_hi), q_base))  # fmt: skip
    toks = p * PAGE + offs_t
    live = (toks >= lo) & (toks < seq_len) & ok
    s = s * (k_scale * qk_scale_log2)[:, None]
    if USE_SOFT_CAP:  # cap * tanh(x / cap), tanh(y) = 1 - 2 / (exp(2y) + 1)
        s = s / _LOG2E
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0)) * _LOG2E
    v_scales = tl.where(live, v_scale * PV_SCALE, 0.0)
    return tl.where(live[:, None], s, float("-inf")), v, v_zp, v_scales


@triton.jit
def page_4bit(
    q_lo, q_hi, q_base, q_sum, kv_desc, table, p, p_end, col, lo, seq_len, qk_scale_log2, soft_cap,
    offs_t, scale_desc, kh, PAGE: tl.constexpr, W: tl.constexpr, DOT: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, PV_SCALE: tl.constexpr, K8V4: tl.constexpr,
):  # fmt: skip
    """Page ``p``'s (logits [PAGE, BLOCK_G], V bytes, zero points, v scales): ``page_k8v4``
    where ``K8V4``, else ``int4.page_int4`` (which alone takes q's offset terms)."""
    if K8V4:
        return page_k8v4(
            q_lo, q_hi, q_base, kv_desc, table, p, p_end, col, lo, seq_len, qk_scale_log2, soft_cap,
            offs_t, scale_desc, kh, PAGE, W, DOT, USE_SOFT_CAP, PV_SCALE,
        )  # fmt: skip
    return page_int4(
        q_lo, q_hi, q_base, q_sum, kv_desc, table, p, p_end, col, lo, seq_len, qk_scale_log2,
        soft_cap, offs_t, scale_desc, kh, PAGE, W, DOT, USE_SOFT_CAP, PV_SCALE,
    )  # fmt: skip


@triton.jit
def attend_packed(
    q_lo, q_hi, kv_desc, table, p_begin, p_end, kh, lo, seq_len, qk_scale_log2, soft_cap,
    scale_desc, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, STAGES: tl.constexpr,
    PPI: tl.constexpr, USE_SOFT_CAP: tl.constexpr, DOT: tl.constexpr, LAZY: tl.constexpr,
    PV_SCALE: tl.constexpr, K8V4: tl.constexpr,
):  # fmt: skip
    """``helpers.attend`` over either 4-bit cache (cache columns ``kh * D / 2``; ``page_4bit``
    reads the pages), ``PPI`` (1, 2 or 4) pages per iteration under one softmax update:
    (acc_lo, acc_hi) [BLOCK_G, D / 2] fp32 unnormalised (the even and odd rotated channels of v,
    columns in ``v_columns`` order, times ``PV_SCALE``), running max, running sum (base 2),
    which ``int4.store_split_int4`` (``unrotate_store``) finishes. int4 (q rotated): the
    prologue takes q's half sums for ``int4.page_int4``'s offset terms, as [PAGE, BLOCK_G]
    products with ones (in the logits' layout). ``LAZY``: the weights are taken against the
    reference max first, and one reduction of ``logit - max`` to a scalar (``_block_top``)
    decides whether it moves (by more than 8, base 2: then the per-head maxima, the rescale and
    the weights again), so the common page pays neither the per-head maxima nor a wait for them
    before its exponentials."""
    col = kh * (D // 2)
    offs_t = tl.arange(0, PAGE)
    m_i = tl.full([BLOCK_G], -1e30 if LAZY else float("-inf"), tl.float32)
    # the weights' sums per token slot, as the logits: summed over the slots after the loop,
    # not over the page's tokens (across lanes) on every page
    l_acc = tl.zeros([PAGE, BLOCK_G], tl.float32)
    acc_lo = tl.zeros([D // 2, BLOCK_G], tl.float32)  # transposed, as the logits
    acc_hi = tl.zeros([D // 2, BLOCK_G], tl.float32)
    # q_base: where each of the logits' two MMA chains (one per half) starts, half of minus the
    # codes' offset times q's sums (the offset leaves each logit inside its chains)
    if K8V4:  # k int8 under widen_biased's offset; no zero points
        q_sum = 0.0
        q_base = tl.zeros([PAGE, BLOCK_G], tl.float32)
        if DOT == tl.float16:
            ones = tl.full([PAGE, D // 2], 1.0, DOT)
            q_sums = tl.dot(ones, tl.trans(q_lo)) + tl.dot(ones, tl.trans(q_hi))
            q_base = -0.5 * int8_offset(DOT) * q_sums
    else:
        ones = tl.full([PAGE, D // 2], 1.0, DOT)
        sum_lo = tl.dot(ones, tl.trans(q_lo))  # [PAGE, BLOCK_G], each column a head's sum
        sum_hi = tl.dot(ones, tl.trans(q_hi))  # q_hi is a 16th (rotate_q)
        q_sum = sum_lo + sum_hi * 16.0
        q_base = -0.5 * offset(DOT) * (sum_lo + sum_hi)
    n_iter = (p_end - p_begin + PPI - 1) // PPI
    for it in tl.range(0, n_iter, num_stages=STAGES):
        p = p_begin + it * PPI
        s0, v0, z0, vs0 = page_4bit(
            q_lo, q_hi, q_base, q_sum, kv_desc, table, p, p_end, col, lo, seq_len, qk_scale_log2,
            soft_cap, offs_t, scale_desc, kh, PAGE, D // 2, DOT, USE_SOFT_CAP, PV_SCALE, K8V4,
        )  # fmt: skip
        s1 = s0
        s2 = s0
        s3 = s0
        if PPI >= 2:
            s1, v1, z1, vs1 = page_4bit(
                q_lo, q_hi, q_base, q_sum, kv_desc, table, p + 1, p_end, col, lo, seq_len,
                qk_scale_log2, soft_cap, offs_t, scale_desc, kh, PAGE, D // 2, DOT, USE_SOFT_CAP,
                PV_SCALE, K8V4,
            )  # fmt: skip
        if PPI >= 4:
            s2, v2, z2, vs2 = page_4bit(
                q_lo, q_hi, q_base, q_sum, kv_desc, table, p + 2, p_end, col, lo, seq_len,
                qk_scale_log2, soft_cap, offs_t, scale_desc, kh, PAGE, D // 2, DOT, USE_SOFT_CAP,
                PV_SCALE, K8V4,
            )  # fmt: skip
            s3, v3, z3, vs3 = page_4bit(
                q_lo, q_hi, q_base, q_sum, kv_desc, table, p + 3, p_end, col, lo, seq_len,
                qk_scale_log2, soft_cap, offs_t, scale_desc, kh, PAGE, D // 2, DOT, USE_SOFT_CAP,
                PV_SCALE, K8V4,
            )  # fmt: skip
        if LAZY:  # the weights against the reference max first; moved (rarely) past 8
            pr0, pr1, pr2, pr3 = _weights(s0, s1, s2, s3, m_i)
            if _block_top(s0, s1, s2, s3, m_i, PPI) > 8.0:
                acc_lo, acc_hi, l_acc, m_i, pr0, pr1, pr2, pr3 = _move_max(
                    acc_lo, acc_hi, l_acc, m_i, s0, s1, s2, s3, PPI
                )  # fmt: skip
        else:
            acc_lo, acc_hi, l_acc, m_i, pr0, pr1, pr2, pr3 = _move_max(
                acc_lo, acc_hi, l_acc, m_i, s0, s1, s2, s3, PPI
            )  # fmt: skip
        l_acc += pr0
        acc_lo, acc_hi = pv(acc_lo, acc_hi, pr0, v0, z0, vs0, DOT)
        if PPI >= 2:
            l_acc += pr1
            acc_lo, acc_hi = pv(acc_lo, acc_hi, pr1, v1, z1, vs1, DOT)
        if PPI >= 4:
            l_acc += pr2
            acc_lo, acc_hi = pv(acc_lo, acc_hi, pr2, v2, z2, vs2, DOT)
            l_acc += pr3
            acc_lo, acc_hi = pv(acc_lo, acc_hi, pr3, v3, z3, vs3, DOT)
    return tl.trans(acc_lo), tl.trans(acc_hi) * 0.0625, m_i, tl.sum(l_acc, axis=0)


@triton.jit
def _weights(s0, s1, s2, s3, m):
    """The softmax weights (base 2) of the iteration's pages' logits against the max ``m``."""
    w = m[None, :]
    return tl.exp2(s0 - w), tl.exp2(s1 - w), tl.exp2(s2 - w), tl.exp2(s3 - w)


@triton.jit
def _move_max(acc_lo, acc_hi, l_acc, m_i, s0, s1, s2, s3, PPI: tl.constexpr):
    """The online softmax's step for the iteration's pages: their per-head maxima, the rescale
    (``int4.rescale``) and their weights against the new max: (acc_lo, acc_hi, l_acc, m_i, the
    four pages' weights; past ``PPI`` the first page's again, unused)."""
    m_blk = _block_max(s0, s1, s2, s3, PPI)
    acc_lo, acc_hi, l_acc, m_i, m_safe = rescale(acc_lo, acc_hi, l_acc, m_i, m_blk)
    pr0, pr1, pr2, pr3 = _weights(s0, s1, s2, s3, m_safe)
    return acc_lo, acc_hi, l_acc, m_i, pr0, pr1, pr2, pr3


@triton.jit
def _block_max(s0, s1, s2, s3, PPI: tl.constexpr):
    """Each head's max logit over the iteration's ``PPI`` pages' logits [PAGE, BLOCK_G]."""
    m = tl.max(s0, axis=0)
    if PPI >= 2:
        m = tl.maximum(m, tl.max(s1, axis=0))
    if PPI >= 4:
        m = tl.maximum(m, tl.maximum(tl.max(s2, axis=0), tl.max(s3, axis=0)))
    return m


@triton.jit
def _block_top(s0, s1, s2, s3, m_i, PPI: tl.constexpr):
    """The largest ``logit - m_i`` (its head's reference max) over the iteration's pages: one
    reduction to a scalar (across the heads, then the tokens: 7 shuffles for a page, against 8
    for the per-head maxima and their largest growth), which decides whether the lazy reference
    max moves; the per-head maxima are taken only then."""
    t = tl.max(tl.max(s0 - m_i[None, :], axis=1), axis=0)
    if PPI >= 2:
        t = tl.maximum(t, tl.max(tl.max(s1 - m_i[None, :], axis=1), axis=0))
    if PPI >= 4:
        t = tl.maximum(t, tl.max(tl.max(s2 - m_i[None, :], axis=1), axis=0))
        t = tl.maximum(t, tl.max(tl.max(s3 - m_i[None, :], axis=1), axis=0))
    return t


@triton.jit
def attend_4bit(
    q_ptr, b, heads, g_mask, stride_qb, stride_qh, rot_ptr, kv_desc, table, p_begin, p_end, kh,
    lo, seq_len, qk_scale_log2, soft_cap, scale_desc, BLOCK_G: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, STAGES: tl.constexpr, PPI: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    DOT: tl.constexpr, LAZY: tl.constexpr, PV_SCALE: tl.constexpr,
    RSQRT_B: tl.constexpr, K8V4: tl.constexpr,
):  # fmt: skip
    """q of ``heads`` of sequence ``b`` in the cache's basis, then the page loop
    (``attend_packed``), for either 4-bit cache (the split grid's and the balanced schedule's):
    ``K8V4`` q's halves, else q rotated (``int4.rotate_q``). Returns the loop's (acc_lo, acc_hi,
    m_i, l_i), which ``int4.unrotate_store`` finishes."""
    if K8V4:
        q_lo, q_hi = q_halves(q_ptr, b, heads, g_mask, stride_qb, stride_qh, D, DOT)
    else:
        q_lo, q_hi = rotate_q(
            q_ptr, b, heads, g_mask, stride_qb, stride_qh, rot_ptr, BLOCK_G, D, DOT, RSQRT_B
        )  # fmt: skip
    return attend_packed(
        q_lo, q_hi, kv_desc, table, p_begin, p_end, kh, lo, seq_len, qk_scale_log2, soft_cap,
        scale_desc, BLOCK_G, D, PAGE, STAGES, PPI, USE_SOFT_CAP, DOT, LAZY, PV_SCALE, K8V4,
    )  # fmt: skip
