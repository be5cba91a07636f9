"""Paged FP8 decode attention in Triton with one bulk tensor copy (TMA) per cache page.

A gathering split-K kernel (retired; git keeps it as ``attention/kernels/triton_decode.py``)
loaded ``BLOCK_N``-token tiles row by row through the page table, with deep stages of large tiles
limiting it to few programs per SM. Here every page of every kv head is one 2-D box
``[page, D]`` of the cache seen as ``[P * 2 * page, KH * D]`` (K rows of page p start at
``2 * page * p``, V rows ``page`` later), loaded by the copy engine into a small shared buffer:
a page is a small box, so many pages are in flight per program at little shared memory. One warp
per program, many programs per SM (split-K), 1-2 pages per loop iteration under one
online-softmax update (``decode_config.tuned``). V's columns are permuted in registers so that
the ``p @ v`` operand loads are 16-byte vectors, not byte gathers (``helpers.page_logits``).
Its speed against copy bandwidth, XQA and FlashInfer's tensor-core decode, per head size:
docs/design/fp8_decode_paths.md.

The page loop and the math are ``helpers.attend``'s: e4m3 -> ``dot_dtype`` (fp16 by default: one
instruction per two values on sm90, exact) in registers, both products accumulate in fp32,
online softmax in base 2, ``k_scale`` folded into the logit scale and ``v_scale`` into the
output; splits merged by log-sum-exp (``helpers.combine_splits``). With many (sequence, kv head)
pairs the split grid neither fills the SMs nor packs into whole waves: there the balanced
schedule (``decode_balanced``, ``decode_config.BALANCED``) gives every program an equal run of
pages.
Per-(token, head) caches (int8 or e4m3 codes, ``kv_scale``) run the same loop with the scales
applied per logit column and per softmax-weight column (``helpers``); in fp16 products the v
scales are pre-multiplied by a power of two (``pv_shift``) that the output divides back out.
An ``int4_per_token_head`` cache (uint8: two rotated codes per byte, zero points in the scales'
low bits) is read in place by ``int4``'s loop, q rotated once per program and the output
un-rotated in the epilogue; a ``k8v4_per_token_head`` one (uint8, 3 slots: k int8, v int4) by
``k8v4``'s, K as the int8 cache, V as the int4 one. Where its grid lands in the narrow range
that measured fast (``decode_config.PAIRED``), an int4 program reads two kv heads' pages
(``int4_pair``): one softmax and one scales copy for both.
CUDA-graph capturable: the descriptor holds the cache pointer (by value, in the launch), the
host reads no device tensor (the scales are read on the device). Import only where Triton is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from torch_kvq.attention.rotation import hadamard_block
from torch_kvq.attention.triton.decode_config import (
    balanced_registers,
    cache_kind,
    default_schedule,
    paired_splits,
    resolve_config,
    sm_count,
)
from torch_kvq.attention.triton.helpers import (
    CODE_DTYPES,
    DOT_DTYPES,
    LOG2E,
    acc_cols,
    attend,
    check_args,
    combine_splits,
    load_q,
    split_outputs,
    split_range,
    store_split,
)
from torch_kvq.attention.triton.int4 import (
    int4_pv_shift,
    rotate_q,
    rotation_matrices,
    scale_descriptor,
    store_split_int4,
)
from torch_kvq.attention.triton.int4_pair import attend_pair
from torch_kvq.attention.triton.k8v4 import attend_4bit


@triton.jit
def _decode_pages(
    q_ptr, kv_desc, block_table_ptr, seq_lens_ptr,
    part_o_ptr, part_lse_ptr, out_ptr, kv_scale_ptr, rot_ptr,
    qk_scale_log2, soft_cap, out_scale, window,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    QH: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, STAGES: tl.constexpr, PPI: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, DOT: tl.constexpr, DIRECT: tl.constexpr,
    LAZY: tl.constexpr, SCALES: tl.constexpr, PV_SCALE: tl.constexpr, INT4: tl.constexpr,
    RSQRT_B: tl.constexpr, K8V4: tl.constexpr, NH: tl.constexpr,
):  # fmt: skip
    """The split grid: one program per (kv head, split, sequence). ``kv_scale_ptr``: the
    per-(token, head) scales when ``SCALES`` (else None; the 4-bit caches': their TMA descriptor,
    ``int4.scale_descriptor``); ``INT4``: the cache is
    ``int4_per_token_head``'s, read by ``int4`` with the rotation matrices at ``rot_ptr``;
    ``K8V4``: ``k8v4_per_token_head``'s, read by ``k8v4`` (the same matrices, for V)."""
    kh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    table = block_table_ptr + b.to(tl.int64) * stride_bt
    lo, p_begin, p_end = split_range(seq_len, window, split, PAGE, NUM_SPLITS, USE_WINDOW)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < NH * G
    heads = kh * (NH * G) + offs_g  # NH = 2: kv heads 2 kh and 2 kh + 1
    if K8V4 or INT4:  # V rotated int4 (k8v4: K int8, q not rotated), un-rotated at the store
        if NH == 2:  # int4, two kv heads a program
            q_lo, q_hi = rotate_q(
                q_ptr, b, heads, g_mask, stride_qb, stride_qh, rot_ptr, BLOCK_G, D, DOT, RSQRT_B
            )  # fmt: skip
            acc_lo, acc_hi, m_i, l_i = attend_pair(
                q_lo, q_hi, kv_desc, table, p_begin, p_end, kh, lo, seq_len, qk_scale_log2,
                soft_cap, kv_scale_ptr, G, BLOCK_G, D, PAGE, STAGES, USE_SOFT_CAP, DOT, LAZY,
                PV_SCALE,
            )  # fmt: skip
        else:
            acc_lo, acc_hi, m_i, l_i = attend_4bit(
                q_ptr, b, heads, g_mask, stride_qb, stride_qh, rot_ptr, kv_desc, table, p_begin,
                p_end, kh, lo, seq_len, qk_scale_log2, soft_cap, kv_scale_ptr, BLOCK_G, D, PAGE,
                STAGES, PPI, USE_SOFT_CAP, DOT, LAZY, PV_SCALE, RSQRT_B, K8V4,
            )  # fmt: skip
        store_split_int4(
            acc_lo, acc_hi, m_i, l_i, b, split, heads, g_mask, out_ptr, part_o_ptr,
            part_lse_ptr, out_scale, rot_ptr, stride_ob, stride_oh, QH, D, NUM_SPLITS, DIRECT,
            DOT, RSQRT_B,
        )  # fmt: skip
    else:
        q = load_q(q_ptr, b, heads, g_mask, tl.arange(0, D), stride_qb, stride_qh, DOT)
        acc, m_i, l_i = attend(
            q, kv_desc, table, p_begin, p_end, kh, lo, seq_len, qk_scale_log2, soft_cap,
            kv_scale_ptr, BLOCK_G, D, PAGE, STAGES, PPI, USE_SOFT_CAP, DOT, LAZY, QH // G,
            SCALES, PV_SCALE,
        )  # fmt: skip
        store_split(
            acc, m_i, l_i, b, split, heads, g_mask, acc_cols(D), out_ptr, part_o_ptr,
            part_lse_ptr, out_scale, stride_ob, stride_oh, QH, D, NUM_SPLITS, DIRECT,
        )  # fmt: skip


def pv_shift(cache_dtype: torch.dtype, dot_dtype: torch.dtype, lazy: bool) -> int:
    """log2 of the power of two that per-token v scales are multiplied by before ``p @ v`` (and
    the output divided by, exactly). In fp16 the weight times scale, ``p * v_scale`` with
    ``v_scale = absmax / QMAX``, falls below fp16's normal range (6.1e-5) for the small values
    that real V heads hold, and loses bits there; the shift moves it up, keeping
    ``p * v_scale * 2^shift`` below fp16's 65504 for |v| up to about 1800 with the lazy rescale
    (weights up to 2^8) and about 28000 without (weights up to 1). A larger |v| overflows to inf
    (the output NaN, never silently clipped); ``dot_dtype`` bf16 (fp32's range) has no shift.
    int4 codes (uint8; ``k8v4_per_token_head``'s V too): ``int4.int4_pv_shift``."""
    if cache_dtype == torch.uint8:
        return int4_pv_shift(dot_dtype, lazy)
    if dot_dtype != torch.float16:
        return 0
    return (4 if lazy else 8) + (0 if cache_dtype == torch.int8 else 2)


def paged_decode_tma(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: float,
    v_scale: float,
    sm_scale: float,
    *,
    max_seq_len: int,
    window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pages_per_iter: int | None = None,
    lazy_rescale: bool | None = None,
    dot_dtype: torch.dtype = torch.float16,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    programs_per_sm: int | None = None,
    max_registers: int | None = None,
    kv_scale: torch.Tensor | None = None,
    kv_heads_per_program: int | None = None,
) -> torch.Tensor:
    """Decode attention, one query token per sequence, over a paged FP8 (or bf16 / fp16) cache, or
    a per-(token, head) one (int8 / e4m3 codes with ``kv_scale``), or an ``int4_per_token_head``
    one (uint8 kv_cache [P, 2, page, KH, D / 2], two rotated codes per byte, with ``kv_scale``
    holding each scale's zero point in its low bits: ``quant``'s int4 section; D >= 32), or a
    ``k8v4_per_token_head`` one, told apart by its 3 slots (uint8 [P, 3, page, KH, D / 2]: k's
    int8 codes as offset-binary bytes in slots 0 / 1, v's int4 codes in slot 2; ``k8v4``; D >= 32).

    q [B, QH, D] (bf16 / fp16, last dim contiguous); kv_cache [P, 2, page, KH, D] contiguous (K at
    ``[:, 0]``, V at ``[:, 1]``; dequantized = value * scale); block_table [B, W] int32: sequence
    b's i-th page is ``block_table[b, i]`` (XQA's dense table; entries past its pages never read);
    seq_lens [B] int32 tokens cached, the new one included: the query sits at ``seq_lens[b] - 1``
    and sees keys at ``pos - window < k <= pos``. ``max_seq_len``: a host bound on seq_lens (picks
    the schedule; never read from the device). ``soft_cap``: logits = soft_cap * tanh(logits /
    soft_cap). ``num_splits``: splits per (sequence, kv head) of the split grid (None: chosen
    from the shape). ``workspace``: (partial out [B, QH, S, D] fp32, lse [B, QH, S] fp32) for
    S = num_splits, else allocated per call. ``dot_dtype``: the operand dtype of both products;
    ``num_stages``: loop iterations in flight per program, ``pages_per_iter`` (1, 2 or 4) pages
    each (K and V), all under one online-softmax update. ``lazy_rescale``: move the softmax
    reference max only when some row's max logit grew by more than 8 in base 2, so the softmax
    weights stay <= 2^8 (FlashAttention-4's trick). ``num_warps``, ``num_stages``,
    ``pages_per_iter``, ``lazy_rescale``, ``max_registers``: None takes
    ``decode_config.tuned(D, cache_kind(kv_cache), page=page)``'s.
    ``programs_per_sm``: the balanced schedule (``decode_balanced``) with that many programs per
    SM (at most as many as fit) instead of the split grid; then ``num_splits`` must be None and
    ``workspace`` is (partial out [P, 2, QH / KH, D], lse [P, 2, QH / KH]) fp32 for P =
    ``balanced_programs(...)``. With both None and no workspace the schedule is
    ``decode_config.default_schedule``'s. ``max_registers``: Triton's ``maxnreg`` (per thread),
    to hold more programs per SM or fewer spills (0: no cap). ``kv_heads_per_program``: 2 runs
    ``int4_pair``'s loop, two neighbouring kv heads a program (an int4 cache with an even KH, one
    page per iteration, the split grid; ``num_splits`` None: ``decode_config.paired_splits``'s);
    None: 2 where ``paired_splits`` takes it and no schedule, workspace or ``pages_per_iter``
    other than 1 is given, else 1. ``kv_scale`` [P, 2, KH, page] fp32
    contiguous: one scale per (token, kv head) for k and v, ``real = code * scale``; ``k_scale``
    and ``v_scale`` must then be 1.0.
    Returns out [B, QH, D] (``q``'s dtype unless ``out`` is given).
    """
    b, qh, d = q.shape
    if kv_cache.dim() != 5:
        raise ValueError(
            f"paged_decode_tma: kv_cache {tuple(kv_cache.shape)} must be [P, 2, page, KH, D]"
        )
    pages, slots, page, kh, dk = kv_cache.shape
    packed = kv_cache.dtype == torch.uint8  # D / 2 bytes a head: int4's, or (3 slots) k8v4's
    k8v4 = packed and slots == 3
    int4 = packed and not k8v4
    if packed and (dk * 2 != d or d < 32):
        raise ValueError(
            f"paged_decode_tma: a uint8 kv_cache is int4_per_token_head's (2 slots) or "
            f"k8v4_per_token_head's (3), D / 2 bytes a head: its last dim must be head_dim / 2 = "
            f"{d // 2} with head_dim >= 32 (q {tuple(q.shape)}), got {dk}"
        )
    if (slots != (3 if k8v4 else 2) or (dk != d and not packed) or qh % kh or d & (d - 1) or d < 16
            or page & (page - 1) or page < 16):  # fmt: skip
        raise ValueError(
            f"paged_decode_tma: q {tuple(q.shape)} / kv_cache {tuple(kv_cache.shape)}: need "
            "kv_cache [P, 2, page, KH, D] with QH % KH == 0, D and page powers of two, D >= 16 and "
            "page >= 16"
        )
    if not kv_cache.is_contiguous() or q.stride(-1) != 1:
        raise ValueError("paged_decode_tma: kv_cache must be contiguous, q's last dim contiguous")
    check_args(
        "paged_decode_tma", q, dict(block_table=block_table, seq_lens=seq_lens),
        dict(dot_dtype=dot_dtype), window,
    )  # fmt: skip
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.stride(1) != 1:
        raise ValueError(
            f"paged_decode_tma: block_table {tuple(block_table.shape)} must be [B={b}, W] with "
            "a contiguous last dim"
        )
    check_scales(kv_cache, kv_scale, k_scale, v_scale)
    kind = cache_kind(kv_cache)
    nh = kv_heads_per_program
    if nh is None:  # two kv heads per program where that grid measured faster (PAIRED)
        nh = 1
        free = num_splits is None and programs_per_sm is None and workspace is None
        if free and int4 and kh % 2 == 0 and pages_per_iter in (None, 1):
            splits, taken = paired_splits(b, kh, max_seq_len, page, d, sm_count(q.device), kind)
            if taken:
                nh, num_splits = 2, splits
    cfg = resolve_config(
        d, kind, nh == 2 and int4, page, num_warps=num_warps, num_stages=num_stages,
        pages_per_iter=pages_per_iter, lazy_rescale=lazy_rescale, max_registers=max_registers,
    )  # fmt: skip
    num_warps, num_stages = cfg["num_warps"], cfg["num_stages"]
    pages_per_iter, lazy_rescale = cfg["pages_per_iter"], cfg["lazy_rescale"]
    max_registers = cfg["max_registers"]
    if pages_per_iter not in (1, 2, 4):
        raise ValueError(
            f"paged_decode_tma: pages_per_iter must be 1, 2 or 4, got {pages_per_iter}"
        )
    if nh not in (1, 2) or (
        nh == 2 and (not int4 or kh % 2 or pages_per_iter != 1 or programs_per_sm is not None)
    ):
        raise ValueError(
            f"paged_decode_tma: kv_heads_per_program={kv_heads_per_program!r}: 1, or 2 for an "
            f"int4_per_token_head cache (got {cache_kind(kv_cache)!r}) with an even kv head count "
            f"(got {kh}), one page per iteration (got {pages_per_iter}) and the split grid "
            f"(programs_per_sm={programs_per_sm!r})"
        )
    if nh == 2 and num_splits is None:
        num_splits = paired_splits(b, kh, max_seq_len, page, d, sm_count(q.device), kind)[0]
    width = d // 2 if packed else d  # bytes (elements) of a head in the cache
    rows = kv_cache.view(pages * slots * page, kh * width)
    desc = TensorDescriptor(rows, list(rows.shape), [kh * width, 1], [page, width])
    g = qh // kh
    pv_scale = 1.0
    if kv_scale is not None:
        pv_scale = float(2 ** pv_shift(kv_cache.dtype, dot_dtype, lazy_rescale))
    common = dict(
        G=g, BLOCK_G=max(8 if packed else 16, triton.next_power_of_2(nh * g)), D=d, PAGE=page,
        STAGES=num_stages,
        PPI=pages_per_iter, USE_WINDOW=window is not None, USE_SOFT_CAP=bool(soft_cap),
        DOT=DOT_DTYPES[dot_dtype], LAZY=lazy_rescale, SCALES=kv_scale is not None,
        PV_SCALE=pv_scale, INT4=int4, K8V4=k8v4,
        RSQRT_B=hadamard_block(d) ** -0.5 if packed else 1.0,
        num_warps=num_warps,
        **({"maxnreg": max_registers} if max_registers else {}),
    )  # fmt: skip
    out_scale = float(v_scale) / pv_scale  # a power of two: exact
    scales = (sm_scale * k_scale * LOG2E, float(soft_cap or 1.0), out_scale, int(window or 0))
    rot = rotation_matrices(d, q.device) if packed else None  # k8v4: U un-rotates its V
    # the 4-bit loops take each page's scales by TMA, with its codes
    scale_arg = scale_descriptor(kv_scale, nh) if packed else kv_scale
    if num_splits is None and programs_per_sm is None:
        splits, balanced = default_schedule(
            b, kh // nh, max_seq_len, page, d, sm_count(q.device), kind
        )  # fmt: skip
        if balanced is not None and workspace is None:
            programs_per_sm, cap = balanced
            regs = balanced_registers(d, cfg, cap, kind, page)  # 4-bit too: spill-free (sm90)
            if regs is not None:
                common.setdefault("maxnreg", regs)
        else:
            num_splits = splits
    if programs_per_sm is not None:
        from torch_kvq.attention.triton.decode_balanced import decode_balanced

        if num_splits is not None or programs_per_sm < 1:
            raise ValueError(
                f"paged_decode_tma: programs_per_sm={programs_per_sm!r} needs num_splits=None "
                f"(got {num_splits!r}) and at least 1 program per SM"
            )
        return decode_balanced(
            q, desc, block_table, seq_lens, scales, out, workspace, max_seq_len, programs_per_sm,
            kh, page, common, scale_arg, rot,
        )  # fmt: skip
    out, part_o, part_lse = split_outputs("paged_decode_tma", q, out, num_splits, workspace)
    _decode_pages[(kh // nh, num_splits, b)](
        q, desc, block_table, seq_lens, part_o, part_lse, out, scale_arg, rot, *scales,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        QH=qh, NUM_SPLITS=num_splits, DIRECT=num_splits == 1, NH=nh, **common,
    )  # fmt: skip
    # an int4 / k8v4 program stores its (partial) output with out_scale applied (un-rotating)
    return combine_splits(part_o, part_lse, out, 1.0 if packed else out_scale, num_splits)


def check_scales(
    kv_cache: torch.Tensor, kv_scale: torch.Tensor | None, k_scale: float, v_scale: float
) -> None:
    """A per-(token, head) cache comes with its scales [P, 2, KH, page] (fp32, contiguous, on the
    cache's device; a 4-bit cache's 16-byte aligned, read by TMA) and per-tensor scales of 1.0;
    an int8 cache and an int4 one (uint8: two codes per byte, the zero point in the scales' low
    bits) always have them. ValueError."""
    fn = "paged_decode_tma"
    if kv_scale is None:
        if kv_cache.dtype == torch.int8:
            raise ValueError(f"{fn}: an int8 cache needs its per-(token, head) kv_scale")
        if kv_cache.dtype == torch.uint8:
            mode = "k8v4" if kv_cache.shape[1] == 3 else "int4"
            raise ValueError(
                f"{fn}: a uint8 ({mode}_per_token_head) cache needs its per-(token, head) "
                "kv_scale [P, 2, KH, page] fp32 (scale and zero point)"
            )
        return
    pages, _, page, kh, _ = kv_cache.shape
    want = (pages, 2, kh, page)
    codes = (*CODE_DTYPES, torch.uint8)
    if kv_cache.dtype not in codes:
        raise ValueError(
            f"{fn}: kv_scale is given, so kv_cache must hold codes ({list(codes)}), got "
            f"{kv_cache.dtype}"
        )
    if (
        tuple(kv_scale.shape) != want
        or kv_scale.dtype != torch.float32
        or not kv_scale.is_contiguous()
        or kv_scale.device != kv_cache.device
    ):
        raise ValueError(
            f"{fn}: kv_scale is {kv_scale.dtype} {tuple(kv_scale.shape)} on {kv_scale.device}; "
            f"expected contiguous float32 {want} on {kv_cache.device}"
        )
    if kv_cache.dtype == torch.uint8 and kv_scale.data_ptr() % 16:
        raise ValueError(
            f"{fn}: a 4-bit cache's kv_scale must start 16-byte aligned (its pages' scales are "
            f"read by TMA), got {kv_scale.data_ptr() % 16} bytes past"
        )
    if k_scale != 1.0 or v_scale != 1.0:
        raise ValueError(
            f"{fn}: k_scale={k_scale!r}, v_scale={v_scale!r} with kv_scale: the scales are per "
            "(token, head), so the per-tensor ones must be 1.0"
        )
