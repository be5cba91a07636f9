"""The row order of a page's 4-bit v codes (int4's slot 1, k8v4's slot 2 of the cache).

Within each 16 tokens of a page whose size is a multiple of 16, token t's v codes sit at row
``v_row_order(D, page)[t]``: the fused decode reads V's rows in that order (triton/int4.py
``v_tile``), which puts the four tokens an MMA quad reads in one instruction on distinct
shared-memory banks under the TMA tile's swizzle (docs/design/int4-branch.md, twentieth
session). k's codes and all scales stay one token a row, in token order.
"""

from __future__ import annotations

import torch

V_ROW_GROUP = 16
# per head size: ``v_tile``'s axis order over a 16-row group viewed as [2, 2, 2, 2] (row bits
# 3..0 as axes 1..4); the tile's row for the decode's token index k follows from it
V_ROW_AXES = {64: (3, 4, 1, 2), 128: (4, 2, 1, 3), 256: (3, 2, 1, 4)}


def v_row_order(d: int, page: int) -> torch.Tensor | None:
    """Row of each of 16 tokens [16] (int64) in a page's 4-bit v codes at head size ``d``; None
    where they sit in token order (a page not a multiple of 16, or no order for ``d``)."""
    axes = V_ROW_AXES.get(d)
    if axes is None or page % V_ROW_GROUP:
        return None
    return torch.arange(V_ROW_GROUP).reshape(2, 2, 2, 2).permute(*(x - 1 for x in axes)).flatten()


def v_rows(offsets: torch.Tensor, d: int, page: int) -> torch.Tensor:
    """Rows in the page [T] of the 4-bit v codes of tokens at page ``offsets`` [T]."""
    order = v_row_order(d, page)
    if order is None:
        return offsets
    j = offsets % V_ROW_GROUP
    return offsets - j + order.to(offsets.device)[j]


def v_rows_to_cache(v: torch.Tensor) -> torch.Tensor:
    """4-bit v codes of whole pages [..., page, KH, D / 2] in token order -> in a cache's row
    order (``v_rows_from_cache``'s inverse)."""
    *_, page, _, w = v.shape
    order = v_row_order(2 * w, page)
    if order is None:
        return v
    g = v.unflatten(-3, (page // V_ROW_GROUP, V_ROW_GROUP))
    out = torch.empty_like(g)
    out[..., order.to(v.device), :, :] = g
    return out.reshape(v.shape)


def v_rows_from_cache(stored: torch.Tensor) -> torch.Tensor:
    """A page's 4-bit v codes as a cache holds them [..., page, KH, D / 2] -> in token order."""
    *_, page, _, w = stored.shape
    order = v_row_order(2 * w, page)
    if order is None:
        return stored
    g = stored.unflatten(-3, (page // V_ROW_GROUP, V_ROW_GROUP))
    return g[..., order.to(stored.device), :, :].reshape(stored.shape)
