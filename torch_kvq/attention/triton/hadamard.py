"""The Walsh-Hadamard butterfly in registers, shared by the int4 cache write (``kv_write``) and the
scratch dequantization (``kv_dequant``): ``rotation.walsh_hadamard``'s fp32 additions in its order,
so a Triton program's rotation equals the aten one bit for bit. Imports Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def hadamard_stage(x, N: tl.constexpr, R: tl.constexpr, H: tl.constexpr):
    """One Walsh-Hadamard stage on x [N, R] (channels first, one row a column): in each group of
    2H channels, with a the first H and c the second, (a, c) -> (a + c, a - c)
    (``rotation.walsh_hadamard``'s order and operations)."""
    y = tl.permute(tl.reshape(x, [N // (2 * H), 2, H, R]), [0, 2, 3, 1])
    a, c = tl.split(y)  # [N / 2H, H, R] each
    y = tl.permute(tl.join(a + c, a - c), [0, 3, 1, 2])
    return tl.reshape(y, [N, R])


@triton.jit
def walsh_hadamard(x, N: tl.constexpr, R: tl.constexpr, LOG2B: tl.constexpr):
    """The unnormalized transform of each block of 2 ** LOG2B channels of x [N, R] (channels
    first): stages H = 1, 2, .., 2 ** (LOG2B - 1)."""
    for s in tl.static_range(LOG2B):
        x = hadamard_stage(x, N, R, 1 << s)
    return x
