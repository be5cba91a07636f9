"""Where a page's 4-bit v codes sit (int4's slot 1, k8v4's slot 2 of the cache).

The fused decode's ``p @ v`` operand holds in each 32-bit register four consecutive tokens of one
byte column (Triton's mixed-precision MMA layout), and each lane reads its eight such words of a
16-token step as two 16-byte loads. So, within each 16 tokens of a page whose size is a multiple
of 16 and a head whose W = D / 2 bytes are a multiple of 32, the byte of token ``16s + 4t + j``
and byte column ``c = g * (W / 8) + 4h + w`` sits at byte ``h * 512 + g * 64 + t * 16 + w * 4 + j``
of that 16-token group's ``16 * W`` bytes (read as rows of W): the four tokens of a word together,
a lane's four words in one 16 bytes, and the eight lanes of each load phase on distinct banks
under the TMA tile's swizzle (``triton/int4.py`` ``v_tile``; docs/design/int4-branch.md). Other
pages and head sizes keep v's codes a token a row. k's codes and all scales stay a token a row.
"""

from __future__ import annotations

import functools

import torch

V_GROUP = 16  # tokens laid out together


def v_layout_applies(w: int, page: int) -> bool:
    """Whether codes of ``w`` bytes a token in pages of ``page`` tokens take the layout."""
    return page % V_GROUP == 0 and w % 32 == 0


@functools.cache
def _group_positions(w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) [16, w] int64 within a 16-token group of the byte of token t, column c; made
    once per (w, ``device``): the eager writes run inside CUDA-graph captures, where a host copy
    per call cannot. Built on the host and copied once, so a first call inside a capture raises
    rather than caching a tensor the capture has not filled."""
    t = torch.arange(V_GROUP)[:, None]
    c = torch.arange(w)[None, :]
    g, i = c // (w // 8), c % (w // 8)
    f = (i // 4) * 512 + g * 64 + (t // 4) * 16 + (i % 4) * 4 + t % 4
    return (f // w).to(device), (f % w).to(device)


def v_positions(offsets: torch.Tensor, w: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) [T, w] in the page of the ``w`` code bytes of the tokens at page
    ``offsets`` [T]."""
    if not v_layout_applies(w, page):
        cols = torch.arange(w, device=offsets.device).expand(offsets.shape[0], w)
        return offsets[:, None].expand(-1, w), cols
    rows, cols = _group_positions(w, offsets.device)
    j = offsets % V_GROUP
    return (offsets - j)[:, None] + rows[j], cols[j]


@functools.cache
def _flat_index(page: int, w: int, device: torch.device) -> torch.Tensor | None:
    """Position (row * w + column) in a page's [page, w] bytes of each token-order byte, flat, on
    ``device`` (made once per key, as ``_group_positions``)."""
    if not v_layout_applies(w, page):
        return None
    rows, cols = v_positions(torch.arange(page), w, page)
    return (rows * w + cols).flatten().to(device)


def v_to_cache(v: torch.Tensor) -> torch.Tensor:
    """4-bit v codes of whole pages [..., page, KH, W] a token a row -> as a cache holds them
    (``v_from_cache``'s inverse)."""
    *_, page, _, w = v.shape
    idx = _flat_index(page, w, v.device)
    if idx is None:
        return v
    src = v.transpose(-3, -2).flatten(-2)  # [..., KH, page * W]
    out = torch.empty_like(src)
    out[..., idx] = src
    return out.unflatten(-1, (page, w)).transpose(-3, -2)


def v_from_cache(stored: torch.Tensor) -> torch.Tensor:
    """A page's 4-bit v codes as a cache holds them [..., page, KH, W] -> a token a row."""
    *_, page, _, w = stored.shape
    idx = _flat_index(page, w, stored.device)
    if idx is None:
        return stored
    src = stored.transpose(-3, -2).flatten(-2)
    return src[..., idx].unflatten(-1, (page, w)).transpose(-3, -2)
