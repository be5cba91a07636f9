"""Split-K ("flash-decoding") paged decode attention in Triton, for FP8 (e4m3) KV caches.

One new token per sequence. The math stays accurate: only the cache is FP8. Each K / V tile is
widened in registers (e4m3 -> bf16 / fp16 is exact), both matrix products accumulate in fp32,
softmax is online in fp32. ``k_scale`` is folded into the logit scale and ``v_scale`` into the
output, so the FP8 values are never rescaled element by element.

Kernel 1 (``_decode_split``): one program per (kv head, split, sequence). It serves all
G = QH / KH query heads of its kv head at once (each K / V byte is read once), walks its share of
the sequence ``BLOCK_N`` tokens at a time through the page table, and writes the split's
normalised partial output and log-sum-exp (base 2). Kernel 2 (``_combine``) merges the splits
(log-sum-exp merge) and writes the output. With ``num_splits == 1`` kernel 1 writes the output.

CUDA-graph capturable: the host reads no device tensor; every per-sequence length and split
bound is computed on the device from ``seq_lens``. Triton is imported here, so import this module
only where Triton is installed.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # a jit function reads only constexpr globals (Triton 3.6)


@triton.jit
def _split_range(
    seq_len, window, split, BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr
):
    """The first key position the query sees (``lo``) and split ``split``'s blocks of ``BLOCK``
    tokens ``[begin, end)`` (empty past the sequence): the blocks from ``lo``'s to the last,
    shared out evenly."""
    lo = 0
    if USE_WINDOW:  # the query at pos = seq_len - 1 sees keys with pos - window < k_pos
        lo = tl.maximum(seq_len - window, 0)
    lo_blk = lo // BLOCK
    n_blk = (seq_len + BLOCK - 1) // BLOCK - lo_blk
    per_split = (n_blk + NUM_SPLITS - 1) // NUM_SPLITS
    begin = lo_blk + split * per_split
    return lo, begin, tl.minimum(begin + per_split, lo_blk + n_blk)


@triton.jit
def _load_q(q_ptr, b, heads, g_mask, offs_d, stride_qb, stride_qh, DT: tl.constexpr):
    """The query rows of ``heads`` (masked by ``g_mask``) of sequence ``b``, as ``DT``."""
    ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    return tl.load(ptrs, mask=g_mask[:, None], other=0.0).to(DT)


@triton.jit
def _store_out(acc, l_i, o_ptrs, mask, out_scale):
    """The normalised output ``acc / l_i * out_scale`` at ``o_ptrs`` [BLOCK_G, D] where ``mask``."""
    o = acc * (out_scale / l_i)[:, None]
    tl.store(o_ptrs, o.to(o_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _store_part(acc, m_i, l_i, rows, mask, offs_d, part_o_ptr, part_lse_ptr, D: tl.constexpr):
    """A partial result for a log-sum-exp merge: normalised ``acc`` at ``part_o[rows, :]`` and its
    log-sum-exp (base 2; -inf for an empty part) at ``part_lse[rows]``, where ``mask`` [BLOCK_G]."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    tl.store(part_lse_ptr + rows, lse, mask=mask)
    o_ptrs = part_o_ptr + rows[:, None] * D + offs_d[None, :]
    tl.store(o_ptrs, acc / l_safe[:, None], mask=mask[:, None])


@triton.jit
def _store_split(
    acc, m_i, l_i, b, split, heads, g_mask, offs_d, out_ptr, part_o_ptr, part_lse_ptr,
    out_scale, stride_ob, stride_oh,
    QH: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, DIRECT: tl.constexpr,
):  # fmt: skip
    """A program's epilogue: ``acc`` [BLOCK_G, D] (fp32, unnormalised; column j is head dim
    ``offs_d[j]``), running max ``m_i`` and sum ``l_i`` (base 2). ``DIRECT`` (one split): the
    output, scaled by ``out_scale``; else the split's normalised partial output and log-sum-exp
    for ``_combine``."""
    if DIRECT:
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        _store_out(acc, l_i, o_ptrs, g_mask[:, None], out_scale)
    else:
        rows = (b.to(tl.int64) * QH + heads) * NUM_SPLITS + split  # [B, QH, S] row
        _store_part(acc, m_i, l_i, rows, g_mask, offs_d, part_o_ptr, part_lse_ptr, D)


@triton.jit
def _decode_split(
    q_ptr, kv_ptr, kv_indptr_ptr, kv_indices_ptr, seq_lens_ptr,
    part_o_ptr, part_lse_ptr, out_ptr,
    qk_scale_log2, soft_cap, out_scale, window,
    stride_qb, stride_qh,
    stride_cp, stride_ckv, stride_ct, stride_ch,
    stride_ob, stride_oh,
    QH: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    QK_DTYPE: tl.constexpr, PV_DTYPE: tl.constexpr, DIRECT: tl.constexpr,
):  # fmt: skip
    kh = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    page_base = tl.load(kv_indptr_ptr + b)
    lo, t_begin, t_end = _split_range(seq_len, window, split, BLOCK_N, NUM_SPLITS, USE_WINDOW)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    heads = kh * G + offs_g
    q = _load_q(q_ptr, b, heads, g_mask, offs_d, stride_qb, stride_qh, QK_DTYPE)  # [BLOCK_G, D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    head_off = kh * stride_ch + offs_d[None, :]
    for t in range(t_begin, t_end):
        toks = t * BLOCK_N + offs_n
        valid = (toks >= lo) & (toks < seq_len)
        page = tl.load(kv_indices_ptr + page_base + toks // PAGE, mask=valid, other=0)
        row = page.to(tl.int64) * stride_cp + (toks % PAGE) * stride_ct
        k_ptrs = kv_ptr + row[:, None] + head_off
        k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)  # [BLOCK_N, D] fp8
        v = tl.load(k_ptrs + stride_ckv, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(QK_DTYPE)))  # [BLOCK_G, BLOCK_N] fp32
        if USE_SOFT_CAP:  # cap * tanh(x / cap), tanh(y) = 1 - 2 / (exp(2y) + 1)
            s = s * qk_scale_log2 / _LOG2E
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0)) * _LOG2E
        else:
            s = s * qk_scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(PV_DTYPE), v.to(PV_DTYPE))
        m_i = m_new
    _store_split(
        acc, m_i, l_i, b, split, heads, g_mask, offs_d, out_ptr, part_o_ptr, part_lse_ptr,
        out_scale, stride_ob, stride_oh, QH, D, NUM_SPLITS, DIRECT,
    )  # fmt: skip


@triton.jit
def _combine(
    part_o_ptr, part_lse_ptr, out_ptr, out_scale, stride_ob, stride_oh,
    QH: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)
    b = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    s_mask = offs_s < NUM_SPLITS
    base = (b.to(tl.int64) * QH + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(s_mask & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
    o = tl.load(part_o_ptr + (base + offs_s)[:, None] * D + offs_d[None, :], mask=s_mask[:, None])
    o = tl.sum(o * w[:, None], axis=0) * (out_scale / tl.sum(w, axis=0))
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


def check_args(
    fn: str,
    q: torch.Tensor,
    int_tensors: dict[str, torch.Tensor],
    dot_dtypes: dict[str, torch.dtype],
    window: int | None,
) -> None:
    """The checks both decode kernels share (ValueError naming ``fn`` and the bad argument)."""
    for name, t in int_tensors.items():
        if t.dtype != torch.int32 or t.device != q.device:
            raise ValueError(
                f"{fn}: {name} must be int32 on {q.device}, got {t.dtype} on {t.device}"
            )
    for name, dt in dot_dtypes.items():
        if dt not in _DOT_DTYPES:
            raise ValueError(f"{fn}: {name} must be one of {list(_DOT_DTYPES)}, got {dt}")
    if window is not None and window <= 0:
        raise ValueError(f"{fn}: window must be positive, got {window}")


def split_outputs(
    fn: str,
    q: torch.Tensor,
    out: torch.Tensor | None,
    num_splits: int,
    workspace: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out [B, QH, D] (allocated in ``q``'s dtype if None) and the split workspace: partial out
    [B, QH, S, D] and lse [B, QH, S] (fp32; ``workspace`` if given, else allocated; ``out``
    itself, unused, when S = 1)."""
    b, qh, d = q.shape
    if out is None:
        out = torch.empty((b, qh, d), dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"{fn}: out must be {tuple(q.shape)}, last dim contiguous")
    if num_splits == 1:
        return out, out, out
    if workspace is not None:
        part_o, part_lse = workspace
        if part_o.shape != (b, qh, num_splits, d) or part_lse.shape != (b, qh, num_splits):
            raise ValueError(
                f"{fn}: workspace shapes {tuple(part_o.shape)} / {tuple(part_lse.shape)} do not "
                f"match num_splits: need {(b, qh, num_splits, d)} / {(b, qh, num_splits)}"
            )
        return out, part_o, part_lse
    part_o = torch.empty((b, qh, num_splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b, qh, num_splits), dtype=torch.float32, device=q.device)
    return out, part_o, part_lse


def combine_splits(
    part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, v_scale: float, num_splits: int
) -> torch.Tensor:
    """Merge the splits into ``out`` (``_combine``; nothing to do for one split)."""
    if num_splits > 1:
        b, qh, d = out.shape
        _combine[(qh, b)](
            part_o, part_lse, out, float(v_scale), out.stride(0), out.stride(1),
            QH=qh, D=d, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4,
        )  # fmt: skip
    return out


def sm_count(device: torch.device) -> int:
    """The device's SM count (torch caches the properties); 132 (an H200) off CUDA, where the
    interpreter runs the schedules a GPU would."""
    return (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 132
    )


def default_num_splits(batch: int, kv_heads: int, max_seq_len: int, block_n: int, sms: int) -> int:
    """Splits per (sequence, kv head) so the grid fills ``sms`` about 4 times, each split keeping
    at least 8 tiles of ``block_n`` tokens (fewer, longer splits read more per program)."""
    want = math.ceil(4 * sms / (batch * kv_heads))
    most = max(1, math.ceil(max_seq_len / (8 * block_n)))
    return max(1, min(want, most, 64))


def paged_decode_fp8(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
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
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    qk_dtype: torch.dtype = torch.bfloat16,
    pv_dtype: torch.dtype = torch.float16,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention, one query token per sequence, over a paged FP8 (or bf16 / fp16) cache.

    q [B, QH, D] (bf16 / fp16; D a power of two, last dim contiguous);
    kv_cache [P, 2, page, KH, D] (K at ``[:, 0]``, V at ``[:, 1]``; dequantized = value * scale);
    kv_indptr [B + 1] int32: sequence b's pages are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``;
    kv_indices [N] int32 page ids; seq_lens [B] int32 tokens cached, the new one included: the
    query sits at position ``seq_lens[b] - 1`` and sees keys at ``pos - window < k <= pos``.
    ``max_seq_len``: a host bound on seq_lens (picks the split count; never read from the device).
    ``soft_cap``: logits = soft_cap * tanh(logits / soft_cap). ``qk_dtype`` / ``pv_dtype``: the
    operand dtypes of the two products (the widened cache is exact in bf16 and fp16; fp32 runs
    the interpreter, whose bf16 ``tl.dot`` is broken). ``workspace``: (partial out
    [B, QH, S, D] fp32, lse [B, QH, S] fp32) for S = num_splits, else allocated per call.
    Returns out [B, QH, D] (``q``'s dtype unless ``out`` is given).
    """
    b, qh, d = q.shape
    pages, two, page, kh, dk = kv_cache.shape
    if two != 2 or dk != d or qh % kh or d & (d - 1) or block_n % page or block_n & (block_n - 1):
        raise ValueError(
            f"paged_decode_fp8: q {tuple(q.shape)} / kv_cache {tuple(kv_cache.shape)} / "
            f"block_n {block_n}: need kv_cache [P, 2, page, KH, D] with QH % KH == 0, D a power "
            "of two, block_n a power-of-two multiple of the page size"
        )
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("paged_decode_fp8: q and kv_cache need a contiguous last dim")
    check_args(
        "paged_decode_fp8", q, dict(kv_indptr=kv_indptr, kv_indices=kv_indices, seq_lens=seq_lens),
        dict(qk_dtype=qk_dtype, pv_dtype=pv_dtype), window,
    )  # fmt: skip
    if num_splits is None:
        num_splits = default_num_splits(b, kh, max_seq_len, block_n, sm_count(q.device))
    g = qh // kh
    out, part_o, part_lse = split_outputs("paged_decode_fp8", q, out, num_splits, workspace)
    direct = num_splits == 1
    sc = kv_cache.stride()
    _decode_split[(kh, num_splits, b)](
        q, kv_cache, kv_indptr, kv_indices, seq_lens,
        part_o, part_lse, out,
        sm_scale * k_scale * LOG2E, float(soft_cap or 1.0), float(v_scale), int(window or 0),
        q.stride(0), q.stride(1),
        sc[0], sc[1], sc[2], sc[3],
        out.stride(0), out.stride(1),
        QH=qh, G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, PAGE=page,
        BLOCK_N=block_n, NUM_SPLITS=num_splits,
        USE_WINDOW=window is not None, USE_SOFT_CAP=bool(soft_cap),
        QK_DTYPE=_DOT_DTYPES[qk_dtype], PV_DTYPE=_DOT_DTYPES[pv_dtype], DIRECT=direct,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return combine_splits(part_o, part_lse, out, v_scale, num_splits)
