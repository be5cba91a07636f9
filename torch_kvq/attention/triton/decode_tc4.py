"""Paged decode attention over a ``tc4_per_token_head`` cache, read in place: a first Triton
program (split-K, one program per (kv head, split, sequence), pages by plain loads), for
correctness and a first speed; not the TMA scheme of the tuned 4-bit decodes (``decode_tma``).

The cache (``quant_tc``): code rows uint8 [P, 2, page, KH, D / 2] (k in its basis as 16-bit lanes
``A | B << 6 | C_even << 10 | C_odd << 13``, groups A, B, C at 6 / 4 / 3 bits; v a byte per
channel pair of its two rotated halves, in ``v_layout``'s positions), aux uint8 [P, KH, 16 + D /
16, page] (per page and kv head one block: fp16 slots [8, page] of the scales and zero points,
then half 1's fifth bits as rows [D / 16, page]). q arrives in k's dual basis
(``k_basis.basis_qk``), so q . k needs no transform here. Per page:

- k: each lane word to four fp16 operands by the exponent trick (``unpack_k``: ``0x6400 | (lane
  & mask)`` is ``1024 + code * 2^s``; compiled, one shift and four ``lop3`` per eight codes), q's
  group columns divided by those 2^s once per program, one MMA per group (C's two chained); the
  offsets and zero points come off per logit (``q'`` sums times ``1024 + 2^s zp``), then each
  group's logits times its token's fp16 scale, in fp32 (``int4.page_int4``'s scheme);
- v: its bytes centred per element by ``int4.unpack_minus`` (half 1's low 4 bits minus its zero
  point, 16 times half 2's code minus its own), half 1's fifth bits added as 16s; the weights
  times each half's scale into two MMAs;

online softmax in base 2; each half's output un-rotated (``quant.unrotate`` over D / 2 channels)
before the split's store. Imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_kvq.attention.quant import hadamard_block
from torch_kvq.attention.triton.hadamard import walsh_hadamard
from torch_kvq.attention.triton.helpers import (
    INTERPRET,
    combine_splits,
    split_range,
    store_split,
    v_offsets,
)
from torch_kvq.attention.triton.int4 import unpack_minus
from torch_kvq.attention.triton.tc4_aux import KS, KZ, VH, VS, VZ, aux_byte, aux_slot, offset16


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
def _fifth_bits(block, t, PAGE: tl.constexpr, U: tl.constexpr):
    """V half 1's fifth bits of the page's tokens as 16s, fp16 [PAGE, 8 U]: rows ``AUX_V_HIGH``
    .. + U of the aux block, bit j of byte f channel ``f + j * U`` (``quant_tc.pack_fifth_bits``)."""
    rows = tl.arange(0, U) + VH
    x = tl.load(block + rows[None, :] * PAGE + t[:, None]).to(tl.int32)  # [PAGE, U]
    # bit j of each byte at index j of a new last dim (nested joins: the outermost the fastest)
    even = tl.join(tl.join(x & 1, (x >> 4) & 1), tl.join((x >> 2) & 1, (x >> 6) & 1))
    odd = tl.join(tl.join((x >> 1) & 1, (x >> 5) & 1), tl.join((x >> 3) & 1, (x >> 7) & 1))
    bits = tl.reshape(tl.join(even, odd), [PAGE, U, 8])  # [t, f, j]
    return (tl.reshape(tl.permute(bits, (0, 2, 1)), [PAGE, 8 * U]) * 16).to(tl.float16)


@triton.jit
def _scale(block, t, PAGE: tl.constexpr, SLOT: tl.constexpr):
    """fp16 slot SLOT of the page's tokens t [PAGE] (a group's scales), as fp32."""
    return tl.load(aux_slot(block, t, PAGE, SLOT)).to(tl.float32)


@triton.jit
def _zp16(block, t, PAGE: tl.constexpr, BYTE: tl.constexpr, SHIFT: tl.constexpr):
    """Each token's zero point (record byte BYTE, in the fp16 slots' rows) as the fp16 ``1024 +
    zp * 2^SHIFT`` [PAGE] (the bit pattern ``0x6400 | zp << SHIFT``: no conversion)."""
    return offset16(tl.load(aux_byte(block, t, PAGE, BYTE)).to(tl.int32), SHIFT)


@triton.jit
def _q_cols(q_row, cols, g_mask, mult):
    """q's columns ``cols`` times ``mult`` (a power of two: exact), as fp16 [BLOCK_G, n], and
    their sums [BLOCK_G] (fp32, of the fp16 values)."""
    x = tl.load(q_row + cols[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32) * mult
    x = x.to(tl.float16)
    return x, tl.sum(x.to(tl.float32), axis=1)


@triton.jit
def q_groups(q_ptr, b, heads, g_mask, stride_qb, stride_qh, D: tl.constexpr):
    """q's rows of ``heads`` of sequence ``b`` as K's lane operands [BLOCK_G, D / 4] in fp16 (A's
    columns, B's / 64, C's even / 4 and odd / 32: ``unpack_k``'s 2^s taken out), then their sums
    [BLOCK_G] (fp32)."""
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    j = tl.arange(0, D // 4)  # lane j: A_j, B_j, C_2j, C_2j+1
    qa, sum_a = _q_cols(q_row, j, g_mask, 1.0)
    qb, sum_b = _q_cols(q_row, D // 4 + j, g_mask, 1.0 / 64)
    qce, sum_ce = _q_cols(q_row, D // 2 + 2 * j, g_mask, 1.0 / 4)
    qco, sum_co = _q_cols(q_row, D // 2 + 2 * j + 1, g_mask, 1.0 / 32)
    return qa, qb, qce, qco, sum_a, sum_b, sum_ce, sum_co


@triton.jit
def _unrotate(acc, sign_ptr, H: tl.constexpr, BLOCK_G: tl.constexpr, LOG2B: tl.constexpr,
              RSQRT_B: tl.constexpr):  # fmt: skip
    """``quant.unrotate`` over H channels of each row of acc [BLOCK_G, H]: the butterfly, times
    fp32 b^-1/2, times the signs."""
    y = walsh_hadamard(tl.trans(acc), H, BLOCK_G, LOG2B) * RSQRT_B
    return tl.trans(y) * tl.load(sign_ptr + tl.arange(0, H))[None, :]


@triton.jit
def _decode_tc4(
    q_ptr, cache_ptr, aux_ptr, block_table_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr, out_ptr,
    sign_ptr, qk_scale_log2, window,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    c_sp, c_skv, c_ss, c_sh, a_sp, a_sh,
    QH: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr,
    DIRECT: tl.constexpr, LOG2B: tl.constexpr, RSQRT_B: tl.constexpr,
):  # fmt: skip
    kh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    table = block_table_ptr + b.to(tl.int64) * stride_bt
    lo, p_begin, p_end = split_range(seq_len, window, split, PAGE, NUM_SPLITS, USE_WINDOW)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < G
    heads = kh * G + offs_g
    qa, qb, qce, qco, sum_a, sum_b, sum_ce, sum_co = q_groups(
        q_ptr, b, heads, g_mask, stride_qb, stride_qh, D
    )  # fmt: skip
    j4 = tl.arange(0, D // 4)  # a K row's lanes
    U: tl.constexpr = D // 16
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc1 = tl.zeros([BLOCK_G, D // 2], tl.float32)
    acc2 = tl.zeros([BLOCK_G, D // 2], tl.float32)
    t = tl.arange(0, PAGE)
    for p in range(p_begin, p_end):
        page = tl.load(table + p).to(tl.int64)
        k_row = cache_ptr + page * c_sp + t * c_ss + kh * c_sh  # [PAGE] pointers
        v_base = cache_ptr + page * c_sp + c_skv + kh * c_sh
        blk = aux_ptr + page * a_sp + kh * a_sh  # the page's aux block of kv head kh
        lanes = tl.load(k_row.to(tl.pointer_type(tl.int16))[:, None] + j4[None, :])
        ea, eb, ece, eco = unpack_k(lanes)
        # per group: q' . (1024 + 2^s code) - sum(q') (1024 + 2^s zp) = q . (code - zp)
        s_a = tl.dot(qa, tl.trans(ea)) - sum_a[:, None] * _zp16(blk, t, PAGE, KZ, 0)[None, :]
        s_b = tl.dot(qb, tl.trans(eb)) - sum_b[:, None] * _zp16(blk, t, PAGE, KZ + 1, 6)[None, :]
        s_c = tl.dot(qco, tl.trans(eco), tl.dot(qce, tl.trans(ece)))
        s_c -= sum_ce[:, None] * _zp16(blk, t, PAGE, KZ + 2, 2)[None, :]
        s_c -= sum_co[:, None] * _zp16(blk, t, PAGE, KZ + 2, 5)[None, :]
        s = (
            s_a * _scale(blk, t, PAGE, KS // 2)[None, :]
            + s_b * _scale(blk, t, PAGE, KS // 2 + 1)[None, :]
        )
        s += s_c * _scale(blk, t, PAGE, KS // 2 + 2)[None, :]
        toks = p * PAGE + t
        live = (toks >= lo) & (toks < seq_len)
        s = tl.where(live[None, :], s * qk_scale_log2, float("-inf"))  # [BLOCK_G, PAGE]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(w, axis=1)
        # v: byte j = half 1's low 4 bits | half 2's code << 4; half 1's fifth bit in the side row
        tok, col = v_offsets(t, tl.arange(0, D // 2), True, PAGE, c_ss, 1, D // 2)
        vb = tl.load(v_base + tok[:, None] + col[None, :])  # v_layout's positions
        z1 = tl.broadcast_to(_zp16(blk, t, PAGE, VZ, 0)[:, None], [PAGE, D // 2])
        z2 = tl.broadcast_to(_zp16(blk, t, PAGE, VZ + 1, 4)[:, None], [PAGE, D // 2])
        v1, v2 = unpack_minus(vb, z1, z2)  # h1 low - zp1, 16 (h2 - zp2)
        v1 += _fifth_bits(blk, t, PAGE, U)
        w1 = (w * _scale(blk, t, PAGE, VS // 2)[None, :]).to(tl.float16)
        w2 = (w * _scale(blk, t, PAGE, VS // 2 + 1)[None, :]).to(tl.float16)
        acc1 = acc1 * alpha[:, None] + tl.dot(w1, v1)
        acc2 = acc2 * alpha[:, None] + tl.dot(w2, v2)
        m_i = m_new
    acc2 = acc2 * 0.0625  # v2 held 16 times half 2's centred codes
    acc1 = _unrotate(acc1, sign_ptr, D // 2, BLOCK_G, LOG2B, RSQRT_B)
    acc2 = _unrotate(acc2, sign_ptr, D // 2, BLOCK_G, LOG2B, RSQRT_B)
    acc = tl.reshape(tl.permute(tl.join(acc1, acc2), [0, 2, 1]), [BLOCK_G, D])
    store_split(
        acc, m_i, l_i, b, split, heads, g_mask, tl.arange(0, D), out_ptr, part_o_ptr,
        part_lse_ptr, 1.0, stride_ob, stride_oh, QH, D, NUM_SPLITS, DIRECT,
    )  # fmt: skip


def paged_decode_tc4(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    signs: torch.Tensor,
    num_splits: int = 8,
    window: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """One new token per sequence: q [B, QH, D] (in k's dual basis), the tc4 cache and side rows,
    ``block_table`` [B, max pages] int32, ``seq_lens`` [B] int32 -> out [B, QH, D] in q's dtype.
    ``signs``: ``quant.hadamard_signs(D / 2)`` (fp32, on the device). Head sizes 64, 128, 256;
    pages of 16 to 64 tokens; the code rows' last dim contiguous (the byte gathers assume it),
    each page's aux block contiguous (its fp16 slots are read as fp16)."""
    page = kv_cache.shape[2]
    if (
        kv_cache.stride(-1) != 1
        or kv_scale.stride()[-2:] != (page, 1)
        or kv_cache.dtype != torch.uint8
        or kv_scale.dtype != torch.uint8
    ):
        raise ValueError(
            f"paged_decode_tc4: kv_cache / kv_scale must be uint8 with contiguous rows / aux "
            f"blocks, got {kv_cache.dtype} strides {kv_cache.stride()} / {kv_scale.dtype} strides "
            f"{kv_scale.stride()}"
        )
    bsz, qh, d = q.shape
    pages, two, page, kh, half = kv_cache.shape
    g = qh // kh
    out = torch.empty_like(q)
    part_o = torch.empty((bsz, qh, num_splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((bsz, qh, num_splits), dtype=torch.float32, device=q.device)
    blk = hadamard_block(d // 2)
    _decode_tc4[(kh, num_splits, bsz)](
        q, kv_cache, kv_scale, block_table, seq_lens, part_o, part_lse, out, signs,
        sm_scale * 1.4426950408889634, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        kv_scale.stride(0), kv_scale.stride(1),
        QH=qh, G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, PAGE=page,
        NUM_SPLITS=num_splits, USE_WINDOW=window is not None, DIRECT=num_splits == 1,
        LOG2B=blk.bit_length() - 1, RSQRT_B=blk**-0.5, num_warps=num_warps,
    )  # fmt: skip
    return combine_splits(part_o, part_lse, out, 1.0, num_splits)
