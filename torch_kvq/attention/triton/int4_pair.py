"""Device code of the int4 TMA decode with two kv heads per program (``decode_tma`` where ``NH``
is 2): ``int4``'s page loop, two heads at a time.

At head 128 a one-warp program over one kv head spends much of a page on work that does not grow
with the head's bytes: the page table, the scales' copy, the mask, the softmax of its [page,
BLOCK_G] logits and the lazy max's reductions; and a GQA group of 4 fills half of the MMA's N of
8. Here a program takes two neighbouring kv heads (their 2 G <= BLOCK_G query heads on N) and
pays those once for both. Per page, each head's K and V boxes are read and unpacked as
``int4.page_int4``'s (the same descriptor, the same byte order and permutation), one TMA copy
brings both heads' scales, and:

- the logits of all 2 G query heads are one [page, BLOCK_G] tile: each head's codes multiply q
  with the other head's rows zeroed (``q_a``, ``q_b``), so a column gets its own kv head's
  products only, in the same two MMA chains (each through both heads) as ``page_int4``; the
  offsets and zero points leave per column as there, the scales per column (``_by_head``);
- one softmax step (``k8v4._weights``, ``k8v4._block_top``) for both heads;
- ``p @ v`` per head into its own accumulators with the same weights (each query head's own kv
  head's columns are the ones kept, ``_own``, after the loop).

One page per iteration. The epilogue is ``int4``'s (``unrotate_store``) over the 2 G heads.
Imports Triton: import only where Triton is installed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_kvq.attention.triton.helpers import _LOG2E
from torch_kvq.attention.triton.int4 import (
    _split_scale,
    offset,
    page_scales,
    pv_weighted,
    unpack,
    v_tile,
)
from torch_kvq.attention.triton.k8v4 import _block_top, _weights


@triton.jit
def _by_head(x, G: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr):
    """Both heads' values per token [2 * PAGE] (head a's page, then head b's) as the logits'
    [PAGE, BLOCK_G] tile: head a's in the first ``G`` columns, head b's after."""
    a, b = _heads(x, PAGE)
    return tl.where((tl.arange(0, BLOCK_G) >= G)[None, :], b[:, None], a[:, None])


@triton.jit
def _heads(x, PAGE: tl.constexpr):
    """[2 * PAGE] (head a's page, then head b's) -> (head a's [PAGE], head b's [PAGE])."""
    return tl.split(tl.permute(tl.reshape(x, [2, PAGE]), [1, 0]))


@triton.jit
def page_pair(
    q_a_lo, q_a_hi, q_b_lo, q_b_hi, q_base, q_sum, kv_desc, table, p, p_end, col, lo, seq_len,
    qk_scale_log2, soft_cap, offs_t, scale_desc, pair, PAGE: tl.constexpr, W: tl.constexpr,
    DOT: tl.constexpr, USE_SOFT_CAP: tl.constexpr, PV_SCALE: tl.constexpr, G: tl.constexpr,
    BLOCK_G: tl.constexpr,
):  # fmt: skip
    """``int4.page_int4`` for kv heads ``2 * pair`` (a) and ``2 * pair + 1`` (b), whose bytes
    start at cache column ``col``: (base-2 logits [PAGE, BLOCK_G], -inf where masked; a's and
    b's V bytes in ``v_columns`` order; their zero points [PAGE]; the v scales times
    ``PV_SCALE`` per column [PAGE, BLOCK_G], 0 where masked)."""
    ok = p < p_end
    page = tl.load(table + p, mask=ok, other=0)
    row = page * (2 * PAGE)
    k_a = kv_desc.load([row, col])  # [PAGE, W] uint8
    k_b = kv_desc.load([row, col + W])
    v_a = v_tile(kv_desc.load([row + PAGE, col]), PAGE, W)
    v_b = v_tile(kv_desc.load([row + PAGE, col + W]), PAGE, W)
    k_stored, v_stored = page_scales(scale_desc, page, pair, 2 * PAGE)  # both heads' pages
    k_scale, k_zp = _split_scale(k_stored)
    v_scale, v_zp = _split_scale(v_stored)
    a_lo, a_hi = unpack(k_a, DOT)
    b_lo, b_hi = unpack(k_b, DOT)
    # two chains (the halves), each through both heads: a column's other head's q rows are zero
    s = tl.dot(b_lo, tl.trans(q_b_lo), tl.dot(a_lo, tl.trans(q_a_lo), q_base)) + tl.dot(
        b_hi, tl.trans(q_b_hi), tl.dot(a_hi, tl.trans(q_a_hi), q_base)
    )
    s = s - q_sum * _by_head(k_zp, G, BLOCK_G, PAGE).to(tl.float32)
    toks = p * PAGE + offs_t
    live = (toks >= lo) & (toks < seq_len) & ok
    s = s * (_by_head(k_scale, G, BLOCK_G, PAGE) * qk_scale_log2)
    if USE_SOFT_CAP:  # cap * tanh(x / cap), tanh(y) = 1 - 2 / (exp(2y) + 1)
        s = s / _LOG2E
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0)) * _LOG2E
    v_scales = tl.where(live[:, None], _by_head(v_scale, G, BLOCK_G, PAGE) * PV_SCALE, 0.0)
    z_a, z_b = _heads(v_zp, PAGE)
    return tl.where(live[:, None], s, float("-inf")), v_a, v_b, z_a, z_b, v_scales


@triton.jit
def attend_pair(
    q_lo, q_hi, kv_desc, table, p_begin, p_end, pair, lo, seq_len, qk_scale_log2, soft_cap,
    scale_desc, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    STAGES: tl.constexpr, USE_SOFT_CAP: tl.constexpr, DOT: tl.constexpr, LAZY: tl.constexpr,
    PV_SCALE: tl.constexpr,
):  # fmt: skip
    """``k8v4.attend_packed`` for an int4 cache over kv heads ``2 * pair`` and ``2 * pair + 1``,
    one page per iteration: q [BLOCK_G, D / 2] halves (``int4.rotate_q``'s, rows of both heads,
    head a's first ``G``) in, (acc_lo, acc_hi) [BLOCK_G, D / 2] (each row its own kv head's),
    running max and sum out, for ``int4.store_split_int4``."""
    W: tl.constexpr = D // 2
    col = pair * (2 * W)
    offs_t = tl.arange(0, PAGE)
    on_b = (tl.arange(0, BLOCK_G) >= G)[:, None]
    zero = tl.zeros_like(q_lo)
    q_a_lo = tl.where(on_b, zero, q_lo)
    q_b_lo = tl.where(on_b, q_lo, zero)
    q_a_hi = tl.where(on_b, zero, q_hi)
    q_b_hi = tl.where(on_b, q_hi, zero)
    ones = tl.full([PAGE, W], 1.0, DOT)
    sum_lo = tl.dot(ones, tl.trans(q_lo))  # [PAGE, BLOCK_G], each column its head's sum
    sum_hi = tl.dot(ones, tl.trans(q_hi))
    q_sum = sum_lo + sum_hi * 16.0
    q_base = -0.5 * offset(DOT) * (sum_lo + sum_hi)
    m_i = tl.full([BLOCK_G], -1e30 if LAZY else float("-inf"), tl.float32)
    l_acc = tl.zeros([PAGE, BLOCK_G], tl.float32)
    acc_a_lo = tl.zeros([W, BLOCK_G], tl.float32)
    acc_a_hi = tl.zeros([W, BLOCK_G], tl.float32)
    acc_b_lo = tl.zeros([W, BLOCK_G], tl.float32)
    acc_b_hi = tl.zeros([W, BLOCK_G], tl.float32)
    for p in tl.range(p_begin, p_end, num_stages=STAGES):
        s, v_a, v_b, z_a, z_b, v_scales = page_pair(
            q_a_lo, q_a_hi, q_b_lo, q_b_hi, q_base, q_sum, kv_desc, table, p, p_end, col, lo,
            seq_len, qk_scale_log2, soft_cap, offs_t, scale_desc, pair, PAGE, W, DOT,
            USE_SOFT_CAP, PV_SCALE, G, BLOCK_G,
        )  # fmt: skip
        if LAZY:  # the weights against the reference max first; moved (rarely) past 8
            pr = _weights(s, s, s, s, m_i)[0]
            if _block_top(s, s, s, s, m_i, 1) > 8.0:
                acc_a_lo, acc_a_hi, acc_b_lo, acc_b_hi, l_acc, m_i, pr = _move_max(
                    acc_a_lo, acc_a_hi, acc_b_lo, acc_b_hi, l_acc, m_i, s
                )  # fmt: skip
        else:
            acc_a_lo, acc_a_hi, acc_b_lo, acc_b_hi, l_acc, m_i, pr = _move_max(
                acc_a_lo, acc_a_hi, acc_b_lo, acc_b_hi, l_acc, m_i, s
            )  # fmt: skip
        l_acc += pr
        w = (pr * v_scales).to(DOT)
        acc_a_lo, acc_a_hi = pv_weighted(acc_a_lo, acc_a_hi, w, v_a, z_a, DOT)
        acc_b_lo, acc_b_hi = pv_weighted(acc_b_lo, acc_b_hi, w, v_b, z_b, DOT)
    on_b = (tl.arange(0, BLOCK_G) >= G)[None, :]
    acc_lo = tl.where(on_b, acc_b_lo, acc_a_lo)
    acc_hi = tl.where(on_b, acc_b_hi, acc_a_hi)
    return tl.trans(acc_lo), tl.trans(acc_hi) * 0.0625, m_i, tl.sum(l_acc, axis=0)


@triton.jit
def _move_max(acc_a_lo, acc_a_hi, acc_b_lo, acc_b_hi, l_acc, m_i, s):
    """The online softmax's step for a page's logits ``s`` (``int4.rescale`` over both heads'
    accumulators): (the four accumulators, l_acc, the new max, the page's weights against it)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)[None, :]
    pr = _weights(s, s, s, s, m_safe)[0]
    return (acc_a_lo * alpha, acc_a_hi * alpha, acc_b_lo * alpha, acc_b_hi * alpha,
            l_acc * alpha, m_new, pr)  # fmt: skip
