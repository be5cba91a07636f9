"""A tc4 page's pieces for one kv head, for the decode's loops (``decode_tc4_tma``: one kv head a
program; ``tc4_pair``: two): K's lanes and V's bytes to the MMA's fp16 operands by the exponent
trick (``unpack_k``, ``unpack5_minus``), q's group columns as K's lane operands (``q_groups``),
a step's two halves per head: K's operands with the head's slots (``k_side``) and ``p @ v``
into the head's accumulators (``pv``); and the online softmax's step both loops take
(``softmax_step``). The cache's layout and the exponent trick are described in
``decode_tc4_tma``. Imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_kvq.attention.triton.helpers import INTERPRET
from torch_kvq.attention.triton.int4 import rescale, v_tile
from torch_kvq.attention.triton.tc4_aux import SLOTS, fifth_words, offset16, page_slots


@triton.jit
def unpack_k(lanes):
    """K's lanes int16 [PAGE, D / 4] -> fp16 (1024 + A, 1024 + 64 B, 1024 + 4 C_even, 1024 + 32
    C_odd), exactly: compiled, a word of two lanes shifted right by 8 once (C's bits to a lane's
    low 10) and one ``lop3`` (mask, or ``0x6400``) per two codes; the interpreter, which runs no
    PTX, takes the same steps lane by lane."""
    if INTERPRET:
        u = lanes.to(tl.int32) & 0xFFFF
        t = u >> 8
        return (
            ((u & 0x3F) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True),
            ((u & 0x3C0) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True),
            ((t & 0x1C) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True),
            ((t & 0xE0) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True),
        )
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; shr.b32 t, $4, 8; "
        "lop3.b32 $0, $4, 0x003f003f, 0x64006400, 0xea; "
        "lop3.b32 $1, $4, 0x03c003c0, 0x64006400, 0xea; "
        "lop3.b32 $2, t, 0x001c001c, 0x64006400, 0xea; "
        "lop3.b32 $3, t, 0x00e000e0, 0x64006400, 0xea; }",
        "=r,=r,=r,=r,r", [lanes], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True, pack=2,
    )  # fmt: skip


@triton.jit
def _q_cols(q_row, cols, g_mask, mult):
    """q's columns ``cols`` times ``mult`` (a power of two: exact), as fp16 [BLOCK_G, n]."""
    x = tl.load(q_row + cols[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32) * mult
    return x.to(tl.float16)


@triton.jit
def q_groups(q_ptr, b, heads, g_mask, stride_qb, stride_qh, D: tl.constexpr):
    """q's rows of ``heads`` of sequence ``b`` as K's lane operands [BLOCK_G, D / 4] in fp16 (A's
    columns, B's / 64, C's even / 4 and odd / 32: ``unpack_k``'s 2^s taken out); their sums come
    in the logits' layout from MMAs with ones (``_decode_tc4_tma``'s prologue)."""
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    j = tl.arange(0, D // 4)  # lane j: A_j, B_j, C_2j, C_2j+1
    qa = _q_cols(q_row, j, g_mask, 1.0)
    qb = _q_cols(q_row, D // 4 + j, g_mask, 1.0 / 64)
    qce = _q_cols(q_row, D // 2 + 2 * j, g_mask, 1.0 / 4)
    qco = _q_cols(q_row, D // 2 + 2 * j + 1, g_mask, 1.0 / 32)
    return qa, qb, qce, qco


@triton.jit
def unpack5_minus(x, f, z_lo, z_hi):
    """``int4.unpack_minus`` with half 1's fifth bits: V's bytes ``x`` (uint8) and
    ``tc4_aux.fifth_words`` ``f`` -> (low nibble + 16 fifth bit + 1024 - ``z_lo``, ``16 *``
    high nibble + 1024 - ``z_hi``) fp16 each, exactly; compiled, the fifth bits cost nothing
    here: the byte permutes fill with ``0x64`` (fp16's exponent of 1024), so the low nibbles'
    ``lop3`` takes one mask and ORs ``f`` in."""
    if INTERPRET:
        lo = ((x & 0xF).to(tl.uint32) | f | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)
        hi = ((x & 0xF0).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        return lo - z_lo, hi - z_hi
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t0, t1, u; "
        "prmt.b32 t0, $4, 0x64646464, 0x4140; prmt.b32 t1, $4, 0x64646464, 0x4342; "
        "lop3.b32 u, t0, 0x640f640f, $5, 0xea; sub.rn.f16x2 $0, u, $9; "
        "lop3.b32 u, t1, 0x640f640f, $7, 0xea; sub.rn.f16x2 $1, u, $10; "
        "and.b32 u, t0, 0x64f064f0; sub.rn.f16x2 $2, u, $11; "
        "and.b32 u, t1, 0x64f064f0; sub.rn.f16x2 $3, u, $12; }",
        "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [x, f, z_lo, z_hi], dtype=(tl.float16, tl.float16),
        is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def offset32(z, SHIFT: tl.constexpr):
    """``1024 + zp * 2^SHIFT`` (fp32) of zero points z (int32) [STEP]: what a group's logit
    loses per unit of q's group sum (the exponent trick's 1024 and the zero point)."""
    return 1024.0 + z.to(tl.float32) * (1 << SHIFT)


@triton.jit
def k_side(
    k_desc, slot_desc, k_row, blk, col, kh, D: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """kv head ``kh``'s K operands of a step (``unpack_k`` of the box at row ``k_row``) and its
    slots (aux block ``blk``, columns from ``col``): (ea, eb, ece, eco; k's scales sa, sb, sc;
    v's s1, s2, each [STEP] fp16; k's zero points za, zb, zc and v's z1, z2, each [STEP] int32)."""
    ea, eb, ece, eco = unpack_k(k_desc.load([k_row, kh * (D // 4)]))  # [STEP, D / 4] each
    sa, sb, sc, s1, s2, z_ab, z_c1, z_2 = page_slots(slot_desc, blk, col, STEP, SLOTS + D // 32)
    zi = z_ab.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    zc1 = z_c1.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    z2 = z_2.to(tl.int16, bitcast=True).to(tl.int32) & 0xFF
    return ea, eb, ece, eco, sa, sb, sc, s1, s2, zi & 0xFF, zi >> 8, zc1 & 0xFF, zc1 >> 8, z2


@triton.jit
def pv(
    v_desc, bit_desc, v_row, blk, col, kh, z1, z2, w1, w2, acc_lo, acc_hi, D: tl.constexpr,
    STEP: tl.constexpr, BIT_BOX: tl.constexpr,
):  # fmt: skip
    """kv head ``kh``'s ``p @ v`` of a step (V's box at row ``v_row``, the fifth bits of aux block
    ``blk`` from column ``col``, zero points z1, z2 [STEP]) with the weights w1, w2 [STEP,
    BLOCK_G] (fp16, the halves' scales in) into its accumulators [D / 2, BLOCK_G]: (acc_lo,
    acc_hi)."""
    U: tl.constexpr = D // 16
    v = v_tile(v_desc.load([v_row, kh * (D // 2)]), STEP, D // 2)
    z_lo = tl.broadcast_to(offset16(z1, 0)[None, :], [D // 2, STEP])
    z_hi = tl.broadcast_to(offset16(z2, 4)[None, :], [D // 2, STEP])
    fifth = fifth_words(bit_desc, blk, col, 2 * SLOTS + U, U, STEP, BIT_BOX)
    # half 1's 5 bits - zp1, 16 (half 2 - zp2), [D / 2, STEP]: the MMA's A operands
    v_lo, v_hi = unpack5_minus(tl.trans(v), fifth, z_lo, z_hi)
    return tl.dot(v_lo, w1, acc_lo), tl.dot(v_hi, w2, acc_hi)


@triton.jit
def softmax_step(
    s, live, m_i, qk_scale_log2, acc_lo, acc_hi, acc2_lo, acc2_hi, l_acc, LAZY: tl.constexpr,
    TWO: tl.constexpr,
):  # fmt: skip
    """The online softmax's step for a step's logits ``s`` [STEP, BLOCK_G] (tokens ``live``):
    base-2 logits, -inf where not live; the accumulators (and, ``TWO``, the second kv head's
    acc2) and ``l_acc`` rescaled where the max moves (``LAZY``: only when a logit passes it by
    more than 8). Returns (acc_lo, acc_hi, acc2_lo, acc2_hi, l_acc + the weights, m_i, the
    weights [STEP, BLOCK_G])."""
    s = tl.where(live[:, None], s * qk_scale_log2, float("-inf"))
    if LAZY:
        pr = tl.exp2(s - m_i[None, :])
        if tl.max(tl.max(s - m_i[None, :], axis=1), axis=0) > 8.0:
            acc_lo, acc_hi, acc2_lo, acc2_hi, l_acc, m_i, pr = _move_max(
                s, m_i, acc_lo, acc_hi, acc2_lo, acc2_hi, l_acc, TWO
            )  # fmt: skip
    else:
        acc_lo, acc_hi, acc2_lo, acc2_hi, l_acc, m_i, pr = _move_max(
            s, m_i, acc_lo, acc_hi, acc2_lo, acc2_hi, l_acc, TWO
        )  # fmt: skip
    return acc_lo, acc_hi, acc2_lo, acc2_hi, l_acc + pr, m_i, pr


@triton.jit
def _move_max(s, m_i, acc_lo, acc_hi, acc2_lo, acc2_hi, l_acc, TWO: tl.constexpr):
    """``softmax_step``'s move of the max to the step's: (the accumulators and ``l_acc`` rescaled,
    the new max, the step's weights against it)."""
    acc_lo, acc_hi, l_acc, m_new, m_safe = rescale(acc_lo, acc_hi, l_acc, m_i, tl.max(s, 0))
    if TWO:
        alpha = tl.exp2(m_i - m_safe)[None, :]
        acc2_lo, acc2_hi = acc2_lo * alpha, acc2_hi * alpha
    return acc_lo, acc_hi, acc2_lo, acc2_hi, l_acc, m_new, tl.exp2(s - m_safe[None, :])
