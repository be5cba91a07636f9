"""Device code of the tc4 decode with two kv heads per program (``decode_tc4_tma`` where ``NH`` is
2): its page loop, two neighbouring kv heads at a time, as ``int4_pair`` is int4's.

A one-warp program over one kv head spends much of a page on work that does not grow with the
head's bytes: the offsets and scales taken out of its [STEP, BLOCK_G] logits, the softmax, the
weights; and a GQA group of 4 fills half of the MMA's N of 8. Here a program takes kv heads
``kh`` (a) and ``kh + 1`` (b), their 2 G <= BLOCK_G query heads on N, and pays those once for
both. Per step, each head's K and V boxes, slots and fifth bits are read and unpacked as the
one-head loop's (``tc4_unpack.k_side``, ``tc4_unpack.pv``), and:

- the logits of all 2 G query heads are one [STEP, BLOCK_G] tile: each head's codes multiply q
  with the other head's rows zeroed, chained into one accumulator per group; the offsets and
  scales leave per column, a column's own head's (``_col``);
- one online-softmax step for both heads;
- ``p @ v`` per head into its own accumulators with the same weights (each query head's own kv
  head's columns are the ones kept, after the loop).

A 32-token page at head 128 is taken in steps of 16 tokens (``PAIR_STEP``): both heads' operands
of a 32-token step hold more than the registers. Imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_kvq.attention.triton.tc4_unpack import k_side, offset32, pv, softmax_step

# tokens a step of the paired loop takes (``decode_tc4_tma.step_tokens``)
PAIR_STEP = 16


@triton.jit
def _col(a, b, on_b):
    """Per-token values of head a and head b [STEP] as the logits' [STEP, BLOCK_G] tile: b's in
    the columns ``on_b``, a's elsewhere."""
    return tl.where(on_b[None, :], b[:, None], a[:, None])


@triton.jit
def step_pair(
    k_desc, v_desc, slot_desc, bit_desc, k_row, v_row, blk, col, tok0, lo, seq_len, kh,
    qa, qb, qce, qco, ra, rb, rce, rco, sum_a, sum_b, sum_ce, sum_co, on_b,
    acc_a_lo, acc_a_hi, acc_b_lo, acc_b_hi, l_acc, m_i, qk_scale_log2,
    D: tl.constexpr, STEP: tl.constexpr, LAZY: tl.constexpr, PV_SCALE: tl.constexpr,
    BIT_BOX: tl.constexpr,
):  # fmt: skip
    """``decode_tc4_tma._step`` over kv heads ``kh`` (a; aux block ``blk``) and ``kh + 1`` (b;
    ``blk + 1``): q's lane operands ``qa..`` hold a's rows (b's zeroed), ``ra..`` b's (a's
    zeroed); the sums hold each column's own. Returns the updated (acc_a_lo, acc_a_hi, acc_b_lo,
    acc_b_hi, l_acc, m_i)."""
    ea, eb, ece, eco, sa, sb, sc, s1, s2, za, zb, zc, z1, z2 = k_side(
        k_desc, slot_desc, k_row, blk, col, kh, D, STEP
    )  # fmt: skip
    fa, fb, fce, fco, ta, tb, tc, t1, t2, ya, yb, yc, y1, y2 = k_side(
        k_desc, slot_desc, k_row, blk + 1, col, kh + 1, D, STEP
    )  # fmt: skip
    s = tl.dot(fa, tl.trans(ra), tl.dot(ea, tl.trans(qa)))
    s = (s - _col(offset32(za, 0), offset32(ya, 0), on_b) * sum_a) * _col(sa, ta, on_b).to(
        tl.float32
    )
    s_b = tl.dot(fb, tl.trans(rb), tl.dot(eb, tl.trans(qb)))
    s_b -= _col(offset32(zb, 6), offset32(yb, 6), on_b) * sum_b
    s += s_b * _col(sb, tb, on_b).to(tl.float32)
    s_c = tl.dot(ece, tl.trans(qce))
    s_c = tl.dot(fco, tl.trans(rco), tl.dot(fce, tl.trans(rce), tl.dot(eco, tl.trans(qco), s_c)))
    s_c -= _col(offset32(zc, 2), offset32(yc, 2), on_b) * sum_ce
    s_c -= _col(offset32(zc, 5), offset32(yc, 5), on_b) * sum_co
    s += s_c * _col(sc, tc, on_b).to(tl.float32)
    toks = tok0 + tl.arange(0, STEP)
    live = (toks >= lo) & (toks < seq_len)
    acc_a_lo, acc_a_hi, acc_b_lo, acc_b_hi, l_acc, m_i, pr = softmax_step(
        s, live, m_i, qk_scale_log2, acc_a_lo, acc_a_hi, acc_b_lo, acc_b_hi, l_acc, LAZY, True
    )  # fmt: skip
    w1 = (pr * (_col(s1, t1, on_b).to(tl.float32) * PV_SCALE)).to(tl.float16)
    w2 = (pr * (_col(s2, t2, on_b).to(tl.float32) * PV_SCALE)).to(tl.float16)
    acc_a_lo, acc_a_hi = pv(
        v_desc, bit_desc, v_row, blk, col, kh, z1, z2, w1, w2, acc_a_lo, acc_a_hi, D, STEP,
        BIT_BOX,
    )  # fmt: skip
    acc_b_lo, acc_b_hi = pv(
        v_desc, bit_desc, v_row, blk + 1, col, kh + 1, y1, y2, w1, w2, acc_b_lo, acc_b_hi, D,
        STEP, BIT_BOX,
    )  # fmt: skip
    return acc_a_lo, acc_a_hi, acc_b_lo, acc_b_hi, l_acc, m_i


@triton.jit
def attend_pair(
    k_desc, v_desc, slot_desc, bit_desc, table, p_begin, p_end, lo, seq_len, kh,
    qa, qb, qce, qco, sum_a, sum_b, sum_ce, sum_co, acc_lo, acc_hi, l_acc, m_i, qk_scale_log2,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    KH: tl.constexpr, STAGES: tl.constexpr, LAZY: tl.constexpr, PV_SCALE: tl.constexpr,
    BIT_BOX: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """The page loop over kv heads ``kh`` and ``kh + 1`` from pages ``[p_begin, p_end)`` of the
    sequence's ``table``: q's lane operands of both heads' 2 G query heads (a's first ``G``
    rows) and their sums in, each column's own kv head's (acc_lo, acc_hi, l_acc, m_i) out."""
    on_b = tl.arange(0, BLOCK_G) >= G
    zero = tl.zeros_like(qa)
    ra = tl.where(on_b[:, None], qa, zero)
    rb = tl.where(on_b[:, None], qb, zero)
    rce = tl.where(on_b[:, None], qce, zero)
    rco = tl.where(on_b[:, None], qco, zero)
    qa = tl.where(on_b[:, None], zero, qa)
    qb = tl.where(on_b[:, None], zero, qb)
    qce = tl.where(on_b[:, None], zero, qce)
    qco = tl.where(on_b[:, None], zero, qco)
    acc_b_lo = tl.zeros_like(acc_lo)
    acc_b_hi = tl.zeros_like(acc_hi)
    for p in tl.range(p_begin, p_end, num_stages=STAGES):
        page = tl.load(table + p)
        row = page * (2 * PAGE)
        blk = page * KH + kh
        for h in tl.static_range(PAGE // STEP):  # the page's steps of STEP tokens
            acc_lo, acc_hi, acc_b_lo, acc_b_hi, l_acc, m_i = step_pair(
                k_desc, v_desc, slot_desc, bit_desc, row + h * STEP, row + PAGE + h * STEP, blk,
                h * STEP, p * PAGE + h * STEP, lo, seq_len, kh, qa, qb, qce, qco, ra, rb, rce,
                rco, sum_a, sum_b, sum_ce, sum_co, on_b, acc_lo, acc_hi, acc_b_lo, acc_b_hi,
                l_acc, m_i, qk_scale_log2, D, STEP, LAZY, PV_SCALE, BIT_BOX,
            )  # fmt: skip
    acc_lo = tl.where(on_b[None, :], acc_b_lo, acc_lo)
    acc_hi = tl.where(on_b[None, :], acc_b_hi, acc_hi)
    return acc_lo, acc_hi, l_acc, m_i
