"""Where a tc4 aux record's bytes sit in a page's aux block (``quant_tc.aux_to_cache``: contiguous
rows of ``page`` bytes, the 8 fp16 slots as fp16 [8, page], then the fifth bits' rows), for the
Triton programs that write or read it (the cache write, the decode, the scratch pass): the
record's offsets as constexprs, a token's byte and slot addresses, and a zero point as the fp16
offset the exponent trick subtracts. One home for the layout on the device side, as
``quant_tc.aux_positions`` is on the host's. Imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_kvq.attention import quant_tc

KS = tl.constexpr(quant_tc.AUX_K_SCALES)  # k's three fp16 scales (record bytes)
VS = tl.constexpr(quant_tc.AUX_V_SCALES)  # v's two
KZ = tl.constexpr(quant_tc.AUX_K_ZP)  # k's three zero points
VZ = tl.constexpr(quant_tc.AUX_V_ZP)  # v's two
VH = tl.constexpr(quant_tc.AUX_V_HIGH)  # half 1's fifth bits (the block's row too)
SLOTS = tl.constexpr(quant_tc.AUX_SLOTS)  # fp16 slots before them


@triton.jit
def aux_byte(block, t, page, BYTE: tl.constexpr):
    """Address of record byte BYTE of the tokens at page offsets ``t`` in their aux block
    (``block``: its first byte): a slot's byte in the fp16 rows, else row BYTE at the token's
    column."""
    if BYTE < 2 * SLOTS:
        return block + 2 * ((BYTE // 2) * page + t) + BYTE % 2
    return block + BYTE * page + t


@triton.jit
def aux_slot(block, t, page, SLOT: tl.constexpr):
    """Address (fp16) of slot SLOT (a group's scale) of the tokens at page offsets ``t``."""
    return block.to(tl.pointer_type(tl.float16)) + SLOT * page + t


@triton.jit
def offset16(zp, SHIFT: tl.constexpr):
    """Zero points ``zp`` (ints below 2^(10 - SHIFT)) as the fp16 ``1024 + zp * 2^SHIFT``: the bit
    pattern ``0x6400 | zp << SHIFT``, no conversion."""
    return ((zp << SHIFT) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def fifth_bit_at(c, U: tl.constexpr):
    """(byte, bit) among a token's U = D / 16 fifth-bit bytes of V half 1's channels ``c``
    (``quant_tc.fifth_bit_positions``)."""
    g = c // U
    i = c - g * U
    if U % 4 == 0:
        return 4 * (i // 4) + g // 2, 4 * (g % 2) + i % 4
    return i, g
