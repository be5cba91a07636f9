"""Where a tc4 aux record's bytes sit in a page's aux block (``quant_tc.aux_to_cache``: contiguous
rows of ``page`` bytes, the 8 fp16 slots as fp16 [8, page], then the fifth bits' rows), for the
Triton programs that write or read it (the cache write, the decode, the scratch pass): the
record's offsets as constexprs, a token's byte and slot addresses, V's zero points as the fp16
offsets the exponent trick subtracts, and the decode's reads of a page's block: its slots
(``page_slots``) and its fifth bits as V's operand words (``fifth_words``, with the TMA box's rows
``bit_box_rows``). One home for the layout on the device side, as ``quant_tc.aux_positions`` is
on the host's. Imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_kvq.attention import quant_tc
from torch_kvq.attention.triton.helpers import INTERPRET

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
def v_offsets(z_c1, z_2):
    """V's zero points as the fp16 offsets ``unpack5_minus`` subtracts, from their slots (fp16
    [PAGE] each: ``z_c1`` holds half 1's 5-bit zero point in its high byte, ``z_2`` half 2's
    4-bit one in its low byte): (``1024 + zp1``, ``1024 + 16 zp2``), the bit patterns ``0x6400 |
    zp1`` and ``0x6400 | zp2 << 4``; compiled, one shift and one ``lop3`` for two tokens each."""
    x1 = z_c1.to(tl.int16, bitcast=True)
    x2 = z_2.to(tl.int16, bitcast=True)
    if INTERPRET:
        lo = (((x1.to(tl.int32) >> 8) & 0x1F) | 0x6400).to(tl.int16)
        hi = (((x2.to(tl.int32) & 0xF) << 4) | 0x6400).to(tl.int16)
        return lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; shr.b32 t, $2, 8; lop3.b32 $0, t, 0x001f001f, 0x64006400, 0xea; "
        "shl.b32 t, $3, 4; lop3.b32 $1, t, 0x00f000f0, 0x64006400, 0xea; }",
        "=r,=r,r,r", [x1, x2], dtype=(tl.float16, tl.float16), is_pure=True, pack=2,
    )  # fmt: skip


@triton.jit
def fifth_bit_at(c, U: tl.constexpr):
    """(byte, bit) among a token's U = D / 16 fifth-bit bytes of V half 1's channels ``c``
    (``quant_tc.fifth_bit_positions``)."""
    g = c // U
    i = c - g * U
    if U % 4 == 0:
        return 4 * (i // 4) + g // 2, 4 * (g % 2) + i % 4
    return i, g


def bit_box_rows(d: int, page: int) -> int:
    """Rows of the fifth bits' TMA box: their D / 16, or twice that where those would make a box
    under 128 bytes (head 64, 16-token pages). A copy's shared destination must be 128-byte
    aligned, and Triton 3.6 packs the pipeliner's buffers of a smaller box back to back (a
    misaligned-address fault on the GPU; ``tma_kernel_sass``'s ``tma_misaligned``;
    triton-lang/triton#10474, whose fix leaves such a box unpipelined instead)."""
    return max(d // 16, 128 // page)


@triton.jit
def page_slots(slot_desc, blk, col, PAGE: tl.constexpr, ROWS16: tl.constexpr):
    """The 8 fp16 slots of one kv head (its aux block ``blk``) of a page's PAGE tokens from
    ``col``, each [PAGE]."""
    r = tl.permute(tl.reshape(slot_desc.load([blk * ROWS16, col]), [2, 2, 2, PAGE]), [3, 0, 1, 2])
    x0, x1 = tl.split(r)  # slot 4a + 2b + c: c
    x00, x01 = tl.split(x0)  # b
    x10, x11 = tl.split(x1)
    s0, s4 = tl.split(x00)  # a
    s2, s6 = tl.split(x01)
    s1, s5 = tl.split(x10)
    s3, s7 = tl.split(x11)
    return s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def fifth_words(
    bit_desc, blk, col, ROWS8: tl.constexpr, U: tl.constexpr, PAGE: tl.constexpr,
    BOX: tl.constexpr,
):  # fmt: skip
    """Half 1's fifth bits as ``decode_tc4_tma.unpack5_minus``'s words, uint32 [D / 2, PAGE] (the MMA's A
    operand's shape, ``int4.v_tile``'s labels transposed): the element of column c = 32 h + 8 w +
    g, token t holds the word of its register's four tokens (16 s + 4 t' + j, j = 0..3, as V's
    bytes in it), token j's bit at 4 + 8 j; compiled, one shift and one ``lop3`` a register. The
    plane (``quant_tc.fifth_bit_positions``): aux row 4 h + g // 2 of token t holds column c's bit
    at 4 (g % 2) + w, so one row's 4 bytes at tokens 16 s + 4 t' .. + 3 are a word of four tokens
    for 8 columns. The interpreter, which runs no PTX, gets each element its own bit (``b <<
    4``). The box (the aux blocks as int32 words of four tokens) has ``BOX`` rows
    (``bit_box_rows``), the first U the bits, and the words of PAGE tokens from ``col`` (a step of
    a page: ``decode_tc4_tma``'s ``STEP``)."""
    x = bit_desc.load([blk * ROWS8 + 2 * SLOTS, col // 4])  # [BOX, PAGE / 4] int32
    if BOX > U:  # 2 U rows: the next block's first U rows dropped
        x, _ = tl.split(tl.permute(tl.reshape(x, [2, U, PAGE // 4]), [1, 2, 0]))
    H: tl.constexpr = U // 4
    S: tl.constexpr = PAGE // 16
    # h, g // 2, s, t': a word's byte j token j
    q = tl.reshape(x.to(tl.uint32, bitcast=True), [H, 4, S, 4])
    n = tl.arange(0, 2)  # lane g = 2 g2 + n: its bits w in nibble n, each moved to bit 4 + w
    q = q[:, :, None, :, :] << (4 - 4 * n)[None, None, :, None, None]  # [H, 4, 2, S, 4]
    q = tl.permute(tl.reshape(q, [H, 8, S, 4]), [2, 0, 1, 3])  # s, h, g, t'
    w = tl.arange(0, 4)
    f = (q[:, :, :, :, None] >> w[None, None, None, None, :]) & 0x10101010  # [S, H, 8, 4, 4]
    if INTERPRET:  # each element its own bit
        j = tl.arange(0, 4)
        f = (f[:, :, :, :, :, None] >> (8 * j)[None, None, None, None, None, :]) & 0xFF
    else:  # the four elements of a register the word
        f = tl.broadcast_to(f[:, :, :, :, :, None], [S, H, 8, 4, 4, 4])  # s, h, g, t', w, j
    f = tl.permute(f, [1, 4, 2, 0, 3, 5])  # as ``int4.v_tile``
    return tl.reshape(f, [8 * U, PAGE])
