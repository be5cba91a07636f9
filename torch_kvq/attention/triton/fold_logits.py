"""The folded logits of a decode whose GQA group pads the MMA's N of 8 (``decode_tc4_tma``):
the logits' tile [M, N] holds FOLD tokens a row, token ``FOLD r + c // GB`` in column c (GB =
N / FOLD columns a fold, head c % GB), so the work per logit runs on a tile FOLD times smaller;
each column keeps a softmax state of its own, merged per head at the end as splits are. Imports
Triton."""

from __future__ import annotations

import triton
import triton.language as tl


def fold_tokens(group: int, step: int) -> int:
    """Tokens a row of the logits' MMA tile takes (``decode_tc4_tma._step``): 2 where a GQA
    group of up to 4 heads pads the N of 8 and a step of 32 tokens leaves the MMA its 16 rows
    (head 64 and 128 at 32-token pages): the tile's spare columns take the row's odd token, with
    softmax states of their own merged at the end, so the work per logit is on a tile half the
    size; else 1 (64-token steps spill; head 256 takes 16-token steps)."""
    return 2 if group <= 4 and step == 32 else 1


@triton.jit
def fold(x, M: tl.constexpr, GB: tl.constexpr):
    """A per-token [M * FOLD] vector as the folded logits' tile [M, FOLD * GB]: element (r, c)
    is token ``FOLD * r + c // GB``'s."""
    FOLD: tl.constexpr = x.shape[0] // M
    x = tl.broadcast_to(tl.reshape(x, [M, FOLD])[:, :, None], [M, FOLD, GB])
    return tl.reshape(x, [M, FOLD * GB])


@triton.jit
def unfold_weights(w, M: tl.constexpr, GB: tl.constexpr):
    """The folded weights [M, 2 GB] (FOLD 2) as ``p @ v``'s B operand [2 M, 2 GB]: row t, column
    c holds w[t // 2, c] where t's parity is c's half (c // GB), else 0 (times 0 or 1: the FMA
    pipe, not selects)."""
    c = tl.arange(0, 2 * GB)[None, :]
    x = tl.join(w * (c < GB).to(w.dtype), w * (c >= GB).to(w.dtype))  # [M, 2 GB, 2]
    return tl.reshape(tl.permute(x, [0, 2, 1]), [2 * M, 2 * GB])


@triton.jit
def fold_q(q, N: tl.constexpr, FOLD: tl.constexpr, GB: tl.constexpr):
    """q's rows [FOLD * GB, N] (row c: head c % GB's) as the folded logits' B operand [FOLD * N,
    FOLD * GB]: block diagonal, rows f * N .. of column c only where f is c // GB."""
    qt = tl.trans(q)  # [N, BLOCK_G]
    if FOLD == 1:
        return qt
    f = tl.arange(0, FOLD)[:, None] == (tl.arange(0, FOLD * GB) // GB)[None, :]  # [FOLD, BG]
    x = tl.where(f[:, None, :], tl.broadcast_to(qt[None, :, :], [FOLD, N, FOLD * GB]), 0.0)
    return tl.reshape(x, [FOLD * N, FOLD * GB]).to(tl.float16)


@triton.jit
def merge_folds(acc_lo, acc_hi, l_i, m_i, W: tl.constexpr, FOLD: tl.constexpr, GB: tl.constexpr):
    """Each head's FOLD softmax states (columns c, c + GB, ...) merged as splits are; every
    column c then holds head c % GB's."""
    m3 = tl.reshape(m_i, [FOLD, GB])
    m_h = tl.max(m3, axis=0)  # [GB]
    m_safe = tl.where(m_h == float("-inf"), 0.0, m_h)
    sc = tl.exp2(m3 - m_safe[None, :])  # [FOLD, GB]
    lo = tl.sum(tl.reshape(acc_lo, [W, FOLD, GB]) * sc[None, :, :], axis=1)  # [W, GB]
    hi = tl.sum(tl.reshape(acc_hi, [W, FOLD, GB]) * sc[None, :, :], axis=1)
    l_h = tl.sum(tl.reshape(l_i, [FOLD, GB]) * sc, axis=0)
    bc: tl.constexpr = FOLD * GB
    lo = tl.reshape(tl.broadcast_to(lo[:, None, :], [W, FOLD, GB]), [W, bc])
    hi = tl.reshape(tl.broadcast_to(hi[:, None, :], [W, FOLD, GB]), [W, bc])
    l_h = tl.reshape(tl.broadcast_to(l_h[None, :], [FOLD, GB]), [bc])
    m_h = tl.reshape(tl.broadcast_to(m_h[None, :], [FOLD, GB]), [bc])
    return lo, hi, l_h, m_h
