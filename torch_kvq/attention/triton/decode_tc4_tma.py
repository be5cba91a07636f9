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
the prologue, times ``1024 + 2^s zp``), each group's logits times its token's fp16 scale; V's
bytes in ``int4.v_columns`` order (``int4.v_tile``, the cache's ``v_layout``), unpacked straight
into the MMA's A operands (``unpack5_minus``: half 1's fifth bit ORed in by the low nibble's own
``lop3``, from words of the plane built one shift and one ``lop3`` a register pair,
``tc4_aux.fifth_words``; the plane in that order: ``quant_tc.fifth_bit_positions``), centred per
element with each half's zero point; the weights times each half's scale (times ``PV_SCALE``);
online softmax in base 2 (``int4.rescale``; lazy by default: the max moves only past 8). Head 256
takes a page in steps of 16 tokens (``step_tokens``: the boxes hold a step, so a 32-token page's
registers are a 16-token page's, not more than the SM holds). Epilogue:
``int4.unrotate_store`` with the halves' un-rotation as one block-diagonal +-1 matrix
(``rotation_matrices``). Imports Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from torch_kvq.attention import quant_tc
from torch_kvq.attention.quant import _walsh_hadamard, hadamard_block, hadamard_signs
from torch_kvq.attention.triton.decode_config import default_num_splits, sm_count
from torch_kvq.attention.triton.helpers import combine_splits, split_outputs, split_range
from torch_kvq.attention.triton.int4 import store_split_int4, v_columns
from torch_kvq.attention.triton.tc4_aux import bit_box_rows
from torch_kvq.attention.triton.tc4_pair import PAIR_STEP, attend_pair
from torch_kvq.attention.triton.tc4_unpack import k_side, offset32, pv, q_groups, softmax_step

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

# head sizes whose decode takes two kv heads a program by default (``tc4_pair``): head 256's
# pair holds more than the registers (a stack), head 64's is not measured
PAIR_HEADS = (128,)

_ROTATIONS: dict[tuple[int, torch.device], torch.Tensor] = {}


def step_tokens(d: int, page: int, kv_heads_per_program: int = 1) -> int:
    """Tokens of a page the decode's loop takes at a time (its TMA boxes' rows): the page, or
    ``STEP_BY_HEAD``'s (two kv heads a program: ``tc4_pair.PAIR_STEP``) where the page is
    larger."""
    most = PAIR_STEP if kv_heads_per_program == 2 else STEP_BY_HEAD.get(d, page)
    return min(page, most)


def rotation_matrices(d: int, device: torch.device) -> torch.Tensor:
    """[D * D + D] fp16 (cached per (D, device)), ``int4.rotation_matrices``' form for tc4's v:
    U [D, D] +-1, ``(R1^T y1, R2^T y2) * sqrt(b) = u @ U`` for u = (half 1's accumulator, half
    2's), each in ``v_columns`` order (R: ``quant.rotate`` over D / 2 channels, b its block);
    then D zeros (no q rotation)."""
    key = (d, torch.device(device))
    if key not in _ROTATIONS:
        n = d // 2
        a = _walsh_hadamard(torch.eye(n), hadamard_block(n)) * hadamard_signs(n)
        a = a[v_columns(d)]
        u = torch.zeros(d, d)
        u[:n, :n], u[n:, n:] = a, a
        _ROTATIONS[key] = torch.cat((u.flatten(), torch.zeros(d))).half().to(device).contiguous()
    return _ROTATIONS[key]


@triton.jit
def _step(
    k_desc, v_desc, slot_desc, bit_desc, k_row, v_row, blk, col, tok0, lo, seq_len, kh,
    qa, qb, qce, qco, sum_a, sum_b, sum_ce, sum_co, acc_lo, acc_hi, l_acc, m_i, qk_scale_log2,
    D: tl.constexpr, STEP: tl.constexpr, LAZY: tl.constexpr, PV_SCALE: tl.constexpr,
    BIT_BOX: tl.constexpr,
):  # fmt: skip
    """STEP tokens of a page from token ``tok0`` (K's rows from ``k_row``, V's from ``v_row``, the
    aux block ``blk``'s columns from ``col``): their logits, the online softmax, ``p @ v``.
    Returns the updated (acc_lo, acc_hi, l_acc, m_i)."""
    ea, eb, ece, eco, sa, sb, sc, s1, s2, za, zb, zc, z1, z2 = k_side(
        k_desc, slot_desc, k_row, blk, col, kh, D, STEP
    )  # fmt: skip
    s = (tl.dot(ea, tl.trans(qa)) - offset32(za, 0)[:, None] * sum_a) * sa.to(tl.float32)[:, None]
    s += (tl.dot(eb, tl.trans(qb)) - offset32(zb, 6)[:, None] * sum_b) * sb.to(tl.float32)[:, None]
    s_c = tl.dot(eco, tl.trans(qco), tl.dot(ece, tl.trans(qce)))
    s_c -= offset32(zc, 2)[:, None] * sum_ce + offset32(zc, 5)[:, None] * sum_co
    s += s_c * sc.to(tl.float32)[:, None]
    toks = tok0 + tl.arange(0, STEP)
    live = (toks >= lo) & (toks < seq_len)
    acc_lo, acc_hi, _, _, l_acc, m_i, pr = softmax_step(
        s, live, m_i, qk_scale_log2, acc_lo, acc_hi, acc_lo, acc_hi, l_acc, LAZY, False
    )  # fmt: skip
    w1 = (pr * (s1.to(tl.float32) * PV_SCALE)[:, None]).to(tl.float16)
    w2 = (pr * (s2.to(tl.float32) * PV_SCALE)[:, None]).to(tl.float16)
    acc_lo, acc_hi = pv(
        v_desc, bit_desc, v_row, blk, col, kh, z1, z2, w1, w2, acc_lo, acc_hi, D, STEP, BIT_BOX
    )  # fmt: skip
    return acc_lo, acc_hi, l_acc, m_i


@triton.jit
def _decode_tc4_tma(
    q_ptr, k_desc, v_desc, slot_desc, bit_desc, block_table_ptr, seq_lens_ptr, part_o_ptr,
    part_lse_ptr, out_ptr, rot_ptr, qk_scale_log2, window,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    KH: tl.constexpr, QH: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, STAGES: tl.constexpr,
    USE_WINDOW: tl.constexpr, DIRECT: tl.constexpr, RSQRT_B: tl.constexpr, LAZY: tl.constexpr,
    PV_SCALE: tl.constexpr, BIT_BOX: tl.constexpr, STEP: tl.constexpr, NH: tl.constexpr,
):  # fmt: skip
    kh = tl.program_id(0) * NH  # NH = 2: kv heads kh and kh + 1 (``tc4_pair``)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    table = block_table_ptr + b.to(tl.int64) * stride_bt
    lo, p_begin, p_end = split_range(seq_len, window, split, PAGE, NUM_SPLITS, USE_WINDOW)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < NH * G
    heads = kh * G + offs_g
    qa, qb, qce, qco = q_groups(q_ptr, b, heads, g_mask, stride_qb, stride_qh, D)
    # q's group sums in the logits' layout [STEP, BLOCK_G] (products with ones)
    ones = tl.full([STEP, D // 4], 1.0, tl.float16)
    sum_a = tl.dot(ones, tl.trans(qa))
    sum_b = tl.dot(ones, tl.trans(qb))
    sum_ce = tl.dot(ones, tl.trans(qce))
    sum_co = tl.dot(ones, tl.trans(qco))
    m_i = tl.full([BLOCK_G], -1e30 if LAZY else float("-inf"), tl.float32)
    l_acc = tl.zeros([STEP, BLOCK_G], tl.float32)
    acc_lo = tl.zeros([D // 2, BLOCK_G], tl.float32)  # half 1, rows in v_columns order
    acc_hi = tl.zeros([D // 2, BLOCK_G], tl.float32)  # half 2 (16 times)
    if NH == 2:
        acc_lo, acc_hi, l_acc, m_i = attend_pair(
            k_desc, v_desc, slot_desc, bit_desc, table, p_begin, p_end, lo, seq_len, kh, qa, qb,
            qce, qco, sum_a, sum_b, sum_ce, sum_co, acc_lo, acc_hi, l_acc, m_i, qk_scale_log2, G,
            BLOCK_G, D, PAGE, KH, STAGES, LAZY, PV_SCALE, BIT_BOX, STEP,
        )  # fmt: skip
    else:
        for p in tl.range(p_begin, p_end, num_stages=STAGES):
            page = tl.load(table + p)
            row = page * (2 * PAGE)
            blk = page * KH + kh
            for h in tl.static_range(PAGE // STEP):  # the page's steps of STEP tokens
                acc_lo, acc_hi, l_acc, m_i = _step(
                    k_desc, v_desc, slot_desc, bit_desc, row + h * STEP, row + PAGE + h * STEP,
                    blk, h * STEP, p * PAGE + h * STEP, lo, seq_len, kh, qa, qb, qce, qco, sum_a,
                    sum_b, sum_ce, sum_co, acc_lo, acc_hi, l_acc, m_i, qk_scale_log2, D, STEP,
                    LAZY, PV_SCALE, BIT_BOX,
                )  # fmt: skip
    store_split_int4(
        tl.trans(acc_lo), tl.trans(acc_hi) * 0.0625, m_i, tl.sum(l_acc, axis=0), b, split, heads,
        g_mask, out_ptr, part_o_ptr, part_lse_ptr, 1.0 / PV_SCALE, rot_ptr, stride_ob, stride_oh,
        QH, D, NUM_SPLITS, DIRECT, tl.float16, RSQRT_B,
    )  # fmt: skip


def pairs_by_default(d: int, kv_heads: int, group: int) -> bool:
    """Whether the decode takes two kv heads a program unasked: at ``PAIR_HEADS``' head sizes,
    an even kv head count and both heads' query heads within the MMA's N of 8."""
    return d in PAIR_HEADS and kv_heads % 2 == 0 and 2 * group <= 8


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
    kv_heads_per_program: int | None = None,
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
    own choice; no cap measured faster since the fifth bits left their MMA).
    ``kv_heads_per_program``: 2 runs ``tc4_pair``'s loop, two neighbouring kv heads a program
    (an even KH); None: 2 where ``pairs_by_default`` says, else 1. Returns out [B, QH, D] in q's
    dtype. ValueError on other shapes."""
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
    g = qh // kh
    nh = kv_heads_per_program
    if nh is None:
        nh = 2 if pairs_by_default(d, kh, g) else 1
    if nh not in (1, 2) or kh % nh:
        raise ValueError(
            f"paged_decode_tc4_tma: kv_heads_per_program={kv_heads_per_program!r} with {kh} kv "
            f"heads: need 1, or 2 for an even kv head count"
        )
    step = step_tokens(d, page, nh)  # every box holds one step's tokens
    lanes = kv_cache.view(torch.int16).view(pages * 2 * page, kh * d // 4)
    k_desc = TensorDescriptor(lanes, list(lanes.shape), [kh * d // 4, 1], [step, d // 4])
    rows = kv_cache.view(pages * 2 * page, kh * d // 2)
    v_desc = TensorDescriptor(rows, list(rows.shape), [kh * d // 2, 1], [step, d // 2])
    aux8 = kv_scale.view(pages * kh * aux, page)
    box = bit_box_rows(d, step)
    bit_desc = TensorDescriptor(aux8, list(aux8.shape), [page, 1], [box, step])
    aux16 = kv_scale.view(-1).view(torch.float16).view(pages * kh * aux // 2, page)
    slot_desc = TensorDescriptor(aux16, list(aux16.shape), [page, 1], [quant_tc.AUX_SLOTS, step])
    if num_splits is None:
        programs = kh // nh  # per sequence and split
        num_splits = (
            8 if max_seq_len is None else default_splits(bsz, programs, max_seq_len, page, q)
        )
    out, part_o, part_lse = split_outputs("paged_decode_tc4_tma", q, None, num_splits, None)
    _decode_tc4_tma[(kh // nh, num_splits, bsz)](
        q, k_desc, v_desc, slot_desc, bit_desc, block_table, seq_lens, part_o, part_lse, out,
        rotation_matrices(d, q.device), sm_scale * 1.4426950408889634, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        KH=kh, QH=qh, G=g, BLOCK_G=max(8, triton.next_power_of_2(nh * g)), D=d, PAGE=page,
        NUM_SPLITS=num_splits, STAGES=num_stages, USE_WINDOW=window is not None,
        DIRECT=num_splits == 1, RSQRT_B=hadamard_block(d // 2) ** -0.5, LAZY=lazy_rescale,
        PV_SCALE=PV_LAZY if lazy_rescale else PV_EAGER, BIT_BOX=box, STEP=step, NH=nh,
        num_warps=num_warps,
        **({"maxnreg": max_registers} if max_registers else {}),
    )  # fmt: skip
    return combine_splits(part_o, part_lse, out, 1.0, num_splits)
