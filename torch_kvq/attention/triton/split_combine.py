"""The split grid's merge of one query head's partial outputs by their log-sum-exp
(``combine_row``), run by the combine kernel (``helpers.combine_splits``). Imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def combine_row(
    part_o_ptr, part_lse_ptr, out_ptr, out_scale, b, h, stride_ob, stride_oh,
    QH: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """out[b, h] = the splits' partial outputs [B, QH, S, D] weighted by exp2 of their lse [B, QH,
    S] (base 2; a split that saw no token, lse -inf, weighs 0), times ``out_scale``."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    s_mask = offs_s < NUM_SPLITS
    base = (b.to(tl.int64) * QH + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(s_mask & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
    o = tl.load(part_o_ptr + (base + offs_s)[:, None] * D + offs_d[None, :], mask=s_mask[:, None])
    o = tl.sum(o * w[:, None], axis=0) * (out_scale / tl.sum(w, axis=0))
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))
