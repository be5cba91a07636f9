"""Paged decode attention over a ``tc4_per_token_head`` cache, read in place, by the tuned 4-bit
decodes' scheme (``int4``, ``k8v4``): one TMA box per page for K's lanes, one for V's bytes, one
for the page's fp16 slots (scales, zero points) and one for V's fifth bits, the tokens on the
MMA's M dimension and the heads on its N, split-K over the pages.

The cache (``quant_tc``): code rows uint8 [P, 2, page, KH, D / 2] (k in its basis as 16-bit lanes
``A | B << 6 | C_even << 10 | C_odd << 13``, groups A, B, C at 6 / 4 / 3 bits; v a byte per
channel pair of its two rotated halves, in ``v_layout``'s positions), aux uint8 [P, KH, 16 + D /
16, page] (per page and kv head one block: fp16 slots [8, page] of the scales and zero points,
then half 1's fifth bits as rows [D / 16, page]). q arrives in k's dual basis
(``k_basis.basis_qk``), so q . k needs no transform here.

Per page: K's lane words to fp16 operands by the exponent trick (``unpack_k``:
``0x6400 | (lane & mask)`` is ``1024 + code * 2^s``; one ``shr`` and four ``lop3`` per eight
codes), q's group columns divided by those 2^s once per program (``q_groups``), one MMA per group
(C's two chained), the ``1024`` offsets and zero points taken out per logit (q's group sums, from
the prologue, times ``1024 + 2^s zp``, made as fp32 bit patterns), each group's logits times
its token's fp16 scale; V's bytes in ``int4.v_columns`` order (``int4.v_tile``, the cache's
``v_layout``), unpacked straight into the MMA's A operands (``unpack5_minus``: a register's
four low nibbles and their four fifth bits joined by one ``lop3``, from words of the plane built
one shift and one ``lop3`` a register, ``tc4_aux.fifth_words``; the plane in that order:
``quant_tc.fifth_bit_positions``), centred per element with each half's zero point (fp16 bit
patterns, ``tc4_aux.v_offsets``); the weights times each half's scale (times ``PV_SCALE``);
online softmax in base 2 (``int4.rescale``; lazy by default: the max moves only past 8, checked
as one integer reduction, ``past8``). Head 256
takes a page in steps of 16 tokens (``step_tokens``: the boxes hold a step, so a 32-token page's
registers are a 16-token page's, not more than the SM holds). Where a GQA group of up to 4 heads
pads the MMA's N of 8 and a step has 32 tokens (``fold_tokens``), the logits' tile is folded:
row r holds tokens 2r and 2r + 1, the second in the spare columns (K's lanes [32, D / 4] read as
[16, D / 2], q as a block-diagonal B operand), each column its own softmax state, merged per
head at the end as splits are; every per-logit step (offsets, scales, mask, max, exp2, the
weights) then runs on a [16, 8] tile instead of [32, 8]. Epilogue:
``int4.unrotate_store`` with the halves' un-rotation as one block-diagonal +-1 matrix
(``rotation_matrices``). Imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from torch_kvq.attention import quant_tc
from torch_kvq.attention.rotation import hadamard_block, hadamard_signs, walsh_hadamard
from torch_kvq.attention.triton.decode_config import default_num_splits, sm_count
from torch_kvq.attention.triton.fold_logits import (
    fold,
    fold_q,
    fold_tokens,
    merge_folds,
    unfold_weights,
)
from torch_kvq.attention.triton.helpers import INTERPRET, combine_splits, split_outputs, split_range
from torch_kvq.attention.triton.int4 import (
    rescale,
    store_split_int4,
    v_columns,
    v_tile,
)
from torch_kvq.attention.triton.tc4_aux import (
    SLOTS,
    bit_box_rows,
    fifth_words,
    page_slots,
    v_offsets,
)

# the weights times v's scales, times this in fp16 (``int4.int4_pv_shift``'s: 16 eager, 1 lazy)
PV_EAGER, PV_LAZY = 16.0, 1.0

# programs per SM the split grid aims at (``decode_config.default_num_splits``): one resident
# wave (head 128 holds ~11 programs an SM by its registers, head 256 ~8); int4's 8 gives 8
# splits at 32 x 16k, 15.5 programs an SM, and measured slower (docs/design/int4-branch.md)
GRID = 4

# tokens a loop step takes where not the whole page, by head size: head 256's 32-token page in
# one step holds more than the registers (255 and a stack), two of 16 hold what a 16-token page
# does (docs/design/int4-branch.md)
STEP_BY_HEAD = {256: 16}

_ROTATIONS: dict[tuple[int, torch.device], torch.Tensor] = {}


def step_tokens(d: int, page: int) -> int:
    """Tokens of a page the decode's loop takes at a time (its TMA boxes' rows): the page, or
    ``STEP_BY_HEAD``'s where the page is larger."""
    return min(page, STEP_BY_HEAD.get(d, page))


def rotation_matrices(d: int, device: torch.device) -> torch.Tensor:
    """[D * D + D] fp16 (cached per (D, device)), ``int4.rotation_matrices``' form for tc4's v:
    U [D, D] +-1, ``(R1^T y1, R2^T y2) * sqrt(b) = u @ U`` for u = (half 1's accumulator, half
    2's), each in ``v_columns`` order (R: ``rotation.rotate`` over D / 2 channels, b its block);
    then D zeros (no q rotation)."""
    key = (d, torch.device(device))
    if key not in _ROTATIONS:
        n = d // 2
        a = walsh_hadamard(torch.eye(n), hadamard_block(n)) * hadamard_signs(n)
        a = a[v_columns(d)]
        u = torch.zeros(d, d)
        u[:n, :n], u[n:, n:] = a, a
        _ROTATIONS[key] = torch.cat((u.flatten(), torch.zeros(d))).half().to(device).contiguous()
    return _ROTATIONS[key]


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
    ``tc4_aux.fifth_words`` ``f`` -> (low nibble + 16 fifth bit + 1024 - ``z_lo``, ``16 *`` high nibble +
    1024 - ``z_hi``) fp16 each, exactly; compiled, a register's four bytes take their four fifth
    bits in one ``lop3`` (low nibbles, or the word of bits at 4, 12, 20, 28) before the byte
    permutes fill each with ``0x64`` (fp16's exponent of 1024)."""
    if INTERPRET:
        lo = ((x & 0xF).to(tl.uint32) | f | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)
        hi = ((x & 0xF0).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        return lo - z_lo, hi - z_hi
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, u; "
        "lop3.b32 u, $4, 0x0f0f0f0f, $5, 0xea; "
        "prmt.b32 t, u, 0x64646464, 0x4140; sub.rn.f16x2 $0, t, $9; "
        "prmt.b32 t, u, 0x64646464, 0x4342; sub.rn.f16x2 $1, t, $10; "
        "and.b32 u, $4, 0xf0f0f0f0; "
        "prmt.b32 t, u, 0x64646464, 0x4140; sub.rn.f16x2 $2, t, $11; "
        "prmt.b32 t, u, 0x64646464, 0x4342; sub.rn.f16x2 $3, t, $12; }",
        "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [x, f, z_lo, z_hi], dtype=(tl.float16, tl.float16),
        is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def past8(d):
    """Whether any of the logits minus the reference max ``d`` (fp32; -inf where masked) is
    above 8: as int32 bit patterns, ordered as the floats are where one side is positive, so the
    max is an integer reduction (one ``redux.sync`` a warp, not a tree of shuffles)."""
    n: tl.constexpr = d.numel
    bits = tl.reshape(d.to(tl.int32, bitcast=True), [n], can_reorder=True)
    return tl.max(bits, axis=0) > 0x41000000  # 8.0


@triton.jit
def _off(word, AT: tl.constexpr, BITS: tl.constexpr, SHIFT: tl.constexpr):
    """``1024 + zp * 2^SHIFT`` (fp32, exact) of the BITS-bit zero points at bit AT of ``word``
    (int32) [PAGE]: the bit pattern ``0x44800000 | zp << (13 + SHIFT)`` (fp32's 1024, whose
    mantissa's last bit is 2^-13), one shift and one ``lop3``, no conversion."""
    AT2: tl.constexpr = 13 + SHIFT
    mask: tl.constexpr = ((1 << BITS) - 1) << AT2
    return (((word << (AT2 - AT)) & mask) | 0x44800000).to(tl.float32, bitcast=True)


@triton.jit
def _step(
    k_desc, v_desc, slot_desc, bit_desc, k_row, v_row, blk, col, tok0, lo, seq_len, kh,
    qa, qb, qce, qco, sum_a, sum_b, sum_ce, sum_co, acc_lo, acc_hi, l_acc, m_i, qk_scale_log2,
    D: tl.constexpr, STEP: tl.constexpr, LAZY: tl.constexpr, PV_SCALE: tl.constexpr,
    BIT_BOX: tl.constexpr, FOLD: tl.constexpr, GB: tl.constexpr,
):  # fmt: skip
    """STEP tokens of a page from token ``tok0`` (K's rows from ``k_row``, V's from ``v_row``, the
    aux block ``blk``'s columns from ``col``): their logits, the online softmax, ``p @ v``.
    Returns the updated (acc_lo, acc_hi, l_acc, m_i)."""
    U: tl.constexpr = D // 16
    ROWS8: tl.constexpr = 2 * SLOTS + U  # an aux block's rows of PAGE bytes
    M: tl.constexpr = STEP // FOLD  # the folded logits' rows: FOLD tokens a row
    lanes = tl.reshape(k_desc.load([k_row, kh * (D // 4)]), [M, FOLD * (D // 4)])
    ea, eb, ece, eco = unpack_k(lanes)  # [M, FOLD * D / 4] each
    v = v_tile(v_desc.load([v_row, kh * (D // 2)]), STEP, D // 2)
    sa, sb, sc, s1, s2, z_ab, z_c1, z_2 = page_slots(slot_desc, blk, col, STEP, ROWS8 // 2)
    zi = z_ab.to(tl.int16, bitcast=True).to(tl.int32)
    zc1 = z_c1.to(tl.int16, bitcast=True).to(tl.int32)
    # the per-token values in the logits' tile [M, BLOCK_G] (``fold``); K's zero points are
    # 6, 4 and 3 bits (``quant_tc.quantize_group`` clamps them to the codes' range)
    s = (tl.dot(ea, qa) - fold(_off(zi, 0, 6, 0), M, GB) * sum_a) * fold(sa.to(tl.float32), M, GB)
    s += (tl.dot(eb, qb) - fold(_off(zi, 8, 4, 6), M, GB) * sum_b) * fold(sb.to(tl.float32), M, GB)
    s_c = tl.dot(eco, qco, tl.dot(ece, qce))
    s_c -= fold(_off(zc1, 0, 3, 2), M, GB) * sum_ce + fold(_off(zc1, 0, 3, 5), M, GB) * sum_co
    s += s_c * fold(sc.to(tl.float32), M, GB)
    toks = fold(tok0 + tl.arange(0, STEP), M, GB)
    live = (toks >= lo) & (toks < seq_len)
    s = tl.where(live, s * qk_scale_log2, float("-inf"))  # [M, BLOCK_G]
    if LAZY:  # the reference max moves only when a logit passes it by more than 8 (base 2)
        d = s - m_i[None, :]
        pr = tl.exp2(d)
        if past8(d):
            acc_lo, acc_hi, l_acc, m_i, m_safe = rescale(acc_lo, acc_hi, l_acc, m_i, tl.max(s, 0))
            pr = tl.exp2(s - m_safe[None, :])
    else:
        acc_lo, acc_hi, l_acc, m_i, m_safe = rescale(acc_lo, acc_hi, l_acc, m_i, tl.max(s, 0))
        pr = tl.exp2(s - m_safe[None, :])
    l_acc += pr
    z1, z2 = v_offsets(z_c1, z_2)
    z_lo = tl.broadcast_to(z1[None, :], [D // 2, STEP])
    z_hi = tl.broadcast_to(z2[None, :], [D // 2, STEP])
    fifth = fifth_words(bit_desc, blk, col, ROWS8, U, STEP, BIT_BOX)
    # half 1's 5 bits - zp1, 16 (half 2 - zp2), [D / 2, STEP]: the MMA's A operands
    v_lo, v_hi = unpack5_minus(tl.trans(v), fifth, z_lo, z_hi)
    w1 = (pr * fold(s1.to(tl.float32) * PV_SCALE, M, GB)).to(tl.float16)
    w2 = (pr * fold(s2.to(tl.float32) * PV_SCALE, M, GB)).to(tl.float16)
    if FOLD > 1:
        w1 = unfold_weights(w1, M, GB)
        w2 = unfold_weights(w2, M, GB)
    acc_lo = tl.dot(v_lo, w1, acc_lo)
    acc_hi = tl.dot(v_hi, w2, acc_hi)
    return acc_lo, acc_hi, l_acc, m_i


@triton.jit
def _decode_tc4_tma(
    q_ptr, k_desc, v_desc, slot_desc, bit_desc, block_table_ptr, seq_lens_ptr, part_o_ptr,
    part_lse_ptr, out_ptr, rot_ptr, qk_scale_log2, window,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    KH: tl.constexpr, QH: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, STAGES: tl.constexpr,
    USE_WINDOW: tl.constexpr, DIRECT: tl.constexpr, RSQRT_B: tl.constexpr, LAZY: tl.constexpr,
    PV_SCALE: tl.constexpr, BIT_BOX: tl.constexpr, STEP: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    GB: tl.constexpr = BLOCK_G // FOLD  # columns a fold: head c % GB, tokens c // GB mod FOLD
    M: tl.constexpr = STEP // FOLD
    kh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    table = block_table_ptr + b.to(tl.int64) * stride_bt
    lo, p_begin, p_end = split_range(seq_len, window, split, PAGE, NUM_SPLITS, USE_WINDOW)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < G
    heads = kh * G + offs_g
    col_g = offs_g % GB  # a column's head (FOLD > 1: GB >= G)
    qa, qb, qce, qco = q_groups(q_ptr, b, kh * G + col_g, col_g < G, stride_qb, stride_qh, D)
    qa, qb = fold_q(qa, D // 4, FOLD, GB), fold_q(qb, D // 4, FOLD, GB)
    qce, qco = fold_q(qce, D // 4, FOLD, GB), fold_q(qco, D // 4, FOLD, GB)
    # q's group sums in the logits' layout [M, BLOCK_G] (products with ones)
    ones = tl.full([M, FOLD * (D // 4)], 1.0, tl.float16)
    sum_a = tl.dot(ones, qa)
    sum_b = tl.dot(ones, qb)
    sum_ce = tl.dot(ones, qce)
    sum_co = tl.dot(ones, qco)
    m_i = tl.full([BLOCK_G], -1e30 if LAZY else float("-inf"), tl.float32)
    l_acc = tl.zeros([M, BLOCK_G], tl.float32)
    acc_lo = tl.zeros([D // 2, BLOCK_G], tl.float32)  # half 1, rows in v_columns order
    acc_hi = tl.zeros([D // 2, BLOCK_G], tl.float32)  # half 2 (16 times)
    for p in tl.range(p_begin, p_end, num_stages=STAGES):
        page = tl.load(table + p)
        row = page * (2 * PAGE)
        blk = page * KH + kh
        for h in tl.static_range(PAGE // STEP):  # the page's steps of STEP tokens
            acc_lo, acc_hi, l_acc, m_i = _step(
                k_desc, v_desc, slot_desc, bit_desc, row + h * STEP, row + PAGE + h * STEP, blk,
                h * STEP, p * PAGE + h * STEP, lo, seq_len, kh, qa, qb, qce, qco, sum_a, sum_b,
                sum_ce, sum_co, acc_lo, acc_hi, l_acc, m_i, qk_scale_log2, D, STEP, LAZY, PV_SCALE,
                BIT_BOX, FOLD, GB,
            )  # fmt: skip
    l_i = tl.sum(l_acc, axis=0)
    if FOLD > 1:  # each head's FOLD columns (softmax states of their tokens) merged
        acc_lo, acc_hi, l_i, m_i = merge_folds(acc_lo, acc_hi, l_i, m_i, D // 2, FOLD, GB)
    store_split_int4(
        tl.trans(acc_lo), tl.trans(acc_hi) * 0.0625, m_i, l_i, b, split, heads,
        g_mask, out_ptr, part_o_ptr, part_lse_ptr, 1.0 / PV_SCALE, rot_ptr, stride_ob, stride_oh,
        QH, D, NUM_SPLITS, DIRECT, tl.float16, RSQRT_B,
    )  # fmt: skip


def default_splits(batch: int, kv_heads: int, max_seq_len: int, page: int, q: torch.Tensor) -> int:
    """The split grid's splits per (sequence, kv head) for the shape on q's device: ``GRID``
    programs per SM (``decode_config.default_num_splits``)."""
    return default_num_splits(batch, kv_heads, max_seq_len, page, sm_count(q.device), GRID)


def paged_decode_tc4_tma(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_splits: int | None = None,
    window: int | None = None,
    num_warps: int = 1,
    num_stages: int = 6,
    lazy_rescale: bool = True,
    max_seq_len: int | None = None,
    max_registers: int = 0,
) -> torch.Tensor:
    """One new token per sequence over a tc4 cache: q [B, QH, D] in k's dual basis, ``kv_cache``
    uint8 [P, 2, page, KH, D / 2] and ``kv_scale`` uint8 [P, KH, 16 + D / 16, page], both
    contiguous, ``block_table`` [B, max pages] int32, ``seq_lens`` [B] int32; head sizes 64, 128,
    256; pages of 16, 32 or 64 tokens. ``lazy_rescale``: the softmax's reference max moves only
    when a logit passes it by more than 8 (base 2; ``decode_tma``'s). ``num_splits`` None: the
    split grid's default for the shape (``decode_config.default_num_splits`` at ``GRID``
    programs per SM, ``max_seq_len`` a host bound on ``seq_lens``: never read from the device),
    8 without one. ``num_stages``: the pipeliner's, which keeps a page in flight from 6
    (docs/design/int4-branch.md measures 6 and 8). ``max_registers``: Triton's maxnreg (0: its
    own choice; no cap measured faster since the fifth bits left their MMA). Returns out [B, QH,
    D] in q's dtype. ValueError on other shapes."""
    bsz, qh, d = q.shape
    pages, two, page, kh, half = kv_cache.shape
    aux = quant_tc.aux_width(d)
    if (
        d not in (64, 128, 256)
        or page not in (16, 32, 64)
        or (two, half) != (2, d // 2)
        or tuple(kv_scale.shape) != (pages, kh, aux, page)
        or kv_cache.dtype != torch.uint8
        or kv_scale.dtype != torch.uint8
        or not (kv_cache.is_contiguous() and kv_scale.is_contiguous())
        or qh % kh
    ):
        raise ValueError(
            f"paged_decode_tc4_tma: q {tuple(q.shape)}, kv_cache {kv_cache.dtype} "
            f"{tuple(kv_cache.shape)}, kv_scale {kv_scale.dtype} {tuple(kv_scale.shape)}: need "
            f"head size 64 / 128 / 256, pages of 16 / 32 / 64, contiguous uint8 [P, 2, page, KH, "
            f"D / 2] and [P, KH, {aux}, page], QH a multiple of KH"
        )
    step = step_tokens(d, page)  # every box holds one step's tokens
    lanes = kv_cache.view(torch.int16).view(pages * 2 * page, kh * d // 4)
    k_desc = TensorDescriptor(lanes, list(lanes.shape), [kh * d // 4, 1], [step, d // 4])
    rows = kv_cache.view(pages * 2 * page, kh * d // 2)
    v_desc = TensorDescriptor(rows, list(rows.shape), [kh * d // 2, 1], [step, d // 2])
    words = kv_scale.view(-1).view(torch.int32).view(pages * kh * aux, page // 4)
    box = bit_box_rows(d, step)
    bit_desc = TensorDescriptor(words, list(words.shape), [page // 4, 1], [box, step // 4])
    aux16 = kv_scale.view(-1).view(torch.float16).view(pages * kh * aux // 2, page)
    slot_desc = TensorDescriptor(aux16, list(aux16.shape), [page, 1], [quant_tc.AUX_SLOTS, step])
    if num_splits is None:
        num_splits = 8 if max_seq_len is None else default_splits(bsz, kh, max_seq_len, page, q)
    out, part_o, part_lse = split_outputs("paged_decode_tc4_tma", q, None, num_splits, None)
    g = qh // kh
    _decode_tc4_tma[(kh, num_splits, bsz)](
        q, k_desc, v_desc, slot_desc, bit_desc, block_table, seq_lens, part_o, part_lse, out,
        rotation_matrices(d, q.device), sm_scale * 1.4426950408889634, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        KH=kh, QH=qh, G=g, BLOCK_G=max(8, triton.next_power_of_2(g)), D=d, PAGE=page,
        NUM_SPLITS=num_splits, STAGES=num_stages, USE_WINDOW=window is not None,
        DIRECT=num_splits == 1, RSQRT_B=hadamard_block(d // 2) ** -0.5, LAZY=lazy_rescale,
        PV_SCALE=PV_LAZY if lazy_rescale else PV_EAGER, BIT_BOX=box, STEP=step,
        FOLD=fold_tokens(g, step),
        num_warps=num_warps,
        **({"maxnreg": max_registers} if max_registers else {}),
    )  # fmt: skip
    return combine_splits(part_o, part_lse, out, 1.0, num_splits)
