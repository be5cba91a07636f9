"""Paged decode attention over a ``tc4_per_token_head`` cache, read in place: a first Triton
program (split-K, one program per (kv head, split, sequence), pages by plain loads), for
correctness and a first speed; not the TMA scheme of the tuned 4-bit decodes (``decode_tma``).

The cache (``quant_tc``): code rows uint8 [P, 2, page, KH, D / 2] (k in its basis: groups A, B, C
at 6 / 4 / 3 bits in nibbles and 2- and 1-bit planes; v: two rotated halves at 5 and 4 bits),
side rows uint8 [P, KH, 15 + D / 16, page] (fp16 scales, zero points, v's fifth bits). q arrives
in k's dual basis (``k_basis.basis_qk``), so q . k needs no transform here. Per page: each field
of a row (nibbles, 2- and 1-bit planes) loaded once and spread into its codes in registers, the
codes minus their zero points (small integers, exact in fp16) into one MMA per group, each
group's logits times its per-token fp16 scale (k) in fp32; the weights times each half's
per-token scale (v) into two MMAs; online softmax in base 2; each half's output un-rotated
(``quant.unrotate`` over D / 2 channels) before the split's store. Imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_kvq.attention import quant_tc
from torch_kvq.attention.quant import hadamard_block
from torch_kvq.attention.triton.hadamard import walsh_hadamard
from torch_kvq.attention.triton.helpers import combine_splits, split_range, store_split

# a side row's fields (``quant_tc``'s layout): k's three fp16 scales (two bytes each) and zero
# points, v's two, v's first half's fifth bits
_KS = tl.constexpr(quant_tc.AUX_K_SCALES)
_KZ = tl.constexpr(quant_tc.AUX_K_ZP)
_VS = tl.constexpr(quant_tc.AUX_V_SCALES)
_VZ = tl.constexpr(quant_tc.AUX_V_ZP)
_VH = tl.constexpr(quant_tc.AUX_V_HIGH)


@triton.jit
def _field(row, START: tl.constexpr, WIDTH: tl.constexpr, step):
    """Bytes [PAGE, WIDTH] of each row at ``row`` [PAGE] (pointers), from byte START on, one byte
    every ``step`` (1 in a code row; a side row's field stride), as int32."""
    return tl.load(row[:, None] + (tl.arange(0, WIDTH) + START)[None, :] * step).to(tl.int32)


@triton.jit
def _nibbles(x, PAGE: tl.constexpr, M: tl.constexpr):
    """Bytes x [PAGE, M] -> their 2M nibbles [PAGE, 2M], the low one first
    (``quant_tc.pack_plane``'s order)."""
    return tl.reshape(tl.join(x & 15, x >> 4), [PAGE, 2 * M])


@triton.jit
def _pairs(x, PAGE: tl.constexpr, M: tl.constexpr):
    """A 2-bit plane x [PAGE, M] -> its 4M values [PAGE, 4M] in order (value j at bits 2 (j % 4)
    of byte j // 4): nested joins, the outermost the fastest index."""
    v0, v1, v2, v3 = x & 3, (x >> 2) & 3, (x >> 4) & 3, (x >> 6) & 3
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), [PAGE, 4 * M])


@triton.jit
def _bitplane(x, PAGE: tl.constexpr, M: tl.constexpr):
    """A 1-bit plane x [PAGE, M] -> its 8M values [PAGE, 8M] in order (value j at bit j % 8 of
    byte j // 8)."""
    even = tl.join(tl.join(x & 1, (x >> 4) & 1), tl.join((x >> 2) & 1, (x >> 6) & 1))
    odd = tl.join(tl.join((x >> 1) & 1, (x >> 5) & 1), tl.join((x >> 3) & 1, (x >> 7) & 1))
    return tl.reshape(tl.join(even, odd), [PAGE, 8 * M])


@triton.jit
def _scale(side, sf, FIELD: tl.constexpr):
    """A group's fp16 scales [PAGE] from its two side-row bytes (fields FIELD, FIELD + 1), fp32."""
    lo = tl.load(side + FIELD * sf).to(tl.int32)
    hi = tl.load(side + (FIELD + 1) * sf).to(tl.int32)
    return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _centred(codes, side, sf, ZP_FIELD: tl.constexpr):
    """Codes [PAGE, N] minus each token's zero point (side field ZP_FIELD), exact, in fp16, by the
    exponent trick (``int4.unpack``'s): ``code | 0x6400`` as fp16 is 1024 + code, so the
    difference of two such is code - zp with no integer-to-float conversion."""
    zp = (tl.load(side + ZP_FIELD * sf).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
    return (codes.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - zp[:, None]


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
    c_sp, c_skv, c_ss, c_sh, a_sp, a_sh, a_sf, a_ss,
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
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    ja, jc = tl.arange(0, D // 4), tl.arange(0, D // 2)  # a group's columns
    qa = tl.load(q_row + ja[None, :], mask=g_mask[:, None], other=0.0).to(tl.float16)
    qb = tl.load(q_row + D // 4 + ja[None, :], mask=g_mask[:, None], other=0.0).to(tl.float16)
    qc = tl.load(q_row + D // 2 + jc[None, :], mask=g_mask[:, None], other=0.0).to(tl.float16)
    U: tl.constexpr = D // 16
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc1 = tl.zeros([BLOCK_G, D // 2], tl.float32)
    acc2 = tl.zeros([BLOCK_G, D // 2], tl.float32)
    t = tl.arange(0, PAGE)
    for p in range(p_begin, p_end):
        page = tl.load(table + p).to(tl.int64)
        k_row = cache_ptr + page * c_sp + t * c_ss + kh * c_sh  # [PAGE] pointers
        v_row = k_row + c_skv
        side = aux_ptr + page * a_sp + kh * a_sh + t * a_ss
        # k: A = low nibble | high 2 bits << 4, B a nibble, C = low 2 bits | high bit << 2; each
        # field of the row loaded once and spread in registers
        a = _nibbles(_field(k_row, 0, 2 * U, 1), PAGE, 2 * U) | (
            _pairs(_field(k_row, 4 * U, U, 1), PAGE, U) << 4
        )
        bb = _nibbles(_field(k_row, 2 * U, 2 * U, 1), PAGE, 2 * U)
        c = _pairs(_field(k_row, 5 * U, 2 * U, 1), PAGE, 2 * U) | (
            _bitplane(_field(k_row, 7 * U, U, 1), PAGE, U) << 2
        )
        s = tl.dot(qa, tl.trans(_centred(a, side, a_sf, _KZ))) * _scale(side, a_sf, _KS)[None, :]
        s += (
            tl.dot(qb, tl.trans(_centred(bb, side, a_sf, _KZ + 1)))
            * _scale(side, a_sf, _KS + 2)[None, :]
        )
        s += (
            tl.dot(qc, tl.trans(_centred(c, side, a_sf, _KZ + 2)))
            * _scale(side, a_sf, _KS + 4)[None, :]
        )
        toks = p * PAGE + t
        live = (toks >= lo) & (toks < seq_len)
        s = tl.where(live[None, :], s * qk_scale_log2, float("-inf"))  # [BLOCK_G, PAGE]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(w, axis=1)
        # v: half 1 = low nibble | fifth bit (side row) << 4, half 2 a nibble
        v1 = _nibbles(_field(v_row, 0, 4 * U, 1), PAGE, 4 * U) | (
            _bitplane(_field(side, _VH, U, a_sf), PAGE, U) << 4
        )
        v2 = _nibbles(_field(v_row, 4 * U, 4 * U, 1), PAGE, 4 * U)
        w1 = (w * _scale(side, a_sf, _VS)[None, :]).to(tl.float16)
        w2 = (w * _scale(side, a_sf, _VS + 2)[None, :]).to(tl.float16)
        acc1 = acc1 * alpha[:, None] + tl.dot(w1, _centred(v1, side, a_sf, _VZ))
        acc2 = acc2 * alpha[:, None] + tl.dot(w2, _centred(v2, side, a_sf, _VZ + 1))
        m_i = m_new
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
    pages of 16 to 64 tokens; the code rows' last dim contiguous (the byte gathers assume it)."""
    if kv_cache.stride(-1) != 1 or kv_cache.dtype != torch.uint8 or kv_scale.dtype != torch.uint8:
        raise ValueError(
            f"paged_decode_tc4: kv_cache / kv_scale must be uint8 with contiguous rows, got "
            f"{kv_cache.dtype} strides {kv_cache.stride()} / {kv_scale.dtype}"
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
        *kv_scale.stride(),
        QH=qh, G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, PAGE=page,
        NUM_SPLITS=num_splits, USE_WINDOW=window is not None, DIRECT=num_splits == 1,
        LOG2B=blk.bit_length() - 1, RSQRT_B=blk**-0.5, num_warps=num_warps,
    )  # fmt: skip
    return combine_splits(part_o, part_lse, out, 1.0, num_splits)
