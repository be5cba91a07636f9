"""Device code and host checks shared by the Triton decode kernels (``decode_tma`` and its
balanced schedule ``decode_balanced``); ``INTERPRET`` (Triton's interpreter: no inline PTX, no
libdevice) also by the cache writes.

The math every decode program runs: one new token per sequence, all G = QH / KH query heads of a
kv head at once (each K / V byte is read once). A cache page is widened in registers (e4m3 and
int8 -> fp16 / bf16 are exact), both matrix products accumulate in fp32, the softmax is online in
base 2, ``k_scale`` is folded into the logit scale and ``v_scale`` into the output, so FP8 values
are never rescaled element by element. Per-(token, head) caches (``SCALES``) carry one scale per
token and kv head (``kv_scale`` [pages, 2, KH, page]); a token's scale is constant along both
reductions, so its k scale multiplies its logit column and its v scale its softmax-weight column
before ``p @ v`` (the softmax sum takes the unscaled weights): still no per-element
dequantization. A program's part of a sequence ends either as the output (``store_out``) or as
a normalised partial output and its log-sum-exp (``store_part``), merged by ``combine_splits``.
Imports Triton: import only where Triton is installed.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)  # caches read with per-(token, head) scales
LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # a jit function reads only constexpr globals (Triton 3.6)
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")  # no PTX or libdevice there


@triton.jit
def split_range(
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
def load_q(q_ptr, b, heads, g_mask, offs_d, stride_qb, stride_qh, DT: tl.constexpr):
    """The query rows of ``heads`` (masked by ``g_mask``) of sequence ``b``, as ``DT``."""
    ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    return tl.load(ptrs, mask=g_mask[:, None], other=0.0).to(DT)


@triton.jit
def page_logits(
    q, kv_desc, table, p, p_end, col, lo, seq_len, qk_scale_log2, soft_cap, offs_t, scale_ptr, kh,
    PAGE: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    KH: tl.constexpr, SCALES: tl.constexpr, PV_SCALE: tl.constexpr,
):  # fmt: skip
    """Page ``p`` of the run (``p >= p_end``: past it, all logits -inf, page 0 read), one TMA box
    ``[PAGE, D]`` each for K and V: its base-2 logits [BLOCK_G, PAGE] (fp32), its V rows
    [PAGE, D] (cache dtype) with the columns permuted: column ``c = j * (D // 16) + r`` holds head
    dim ``d = 16 * r + j``, and (``SCALES``) its tokens' v scales of kv head ``kh`` times
    ``PV_SCALE`` [PAGE] (0 where masked), else an unused scalar. ``SCALES``: each logit column is
    also scaled by its token's k scale, read from ``scale_ptr`` (``kv_scale``)."""
    ok = p < p_end
    page = tl.load(table + p, mask=ok, other=0)
    row = page * (2 * PAGE)
    k = kv_desc.load([row, col])  # [PAGE, D]
    v = kv_desc.load([row + PAGE, col])
    # ``p @ v`` sums over tokens, so V's columns may come in any order (the output's follow).
    # In this order each lane's mma B fragment (column l // 4 of every 8-column block) is 16
    # contiguous bytes of a row: one 128-bit shared load instead of 16 byte loads.
    v = tl.reshape(tl.permute(tl.reshape(v, [PAGE, D // 16, 16]), [0, 2, 1]), [PAGE, D])
    s = tl.dot(q, tl.trans(widen(k, DOT)))  # [BLOCK_G, PAGE] fp32
    if SCALES:  # the page's k and v scales of kv head kh: PAGE contiguous floats each
        scales = scale_ptr + (page.to(tl.int64) * (2 * KH) + kh) * PAGE + offs_t
        logit_scale = (tl.load(scales) * qk_scale_log2)[None, :]
        toks = p * PAGE + offs_t
        live = (toks >= lo) & (toks < seq_len) & ok
        v_scales = tl.where(live, tl.load(scales + KH * PAGE) * PV_SCALE, 0.0)
    else:
        logit_scale = qk_scale_log2
        v_scales = qk_scale_log2
    if USE_SOFT_CAP:  # cap * tanh(x / cap), tanh(y) = 1 - 2 / (exp(2y) + 1)
        s = s * logit_scale / _LOG2E
        s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0)) * _LOG2E
    else:
        s = s * logit_scale
    toks = p * PAGE + offs_t
    return tl.where(((toks >= lo) & (toks < seq_len) & ok)[None, :], s, float("-inf")), v, v_scales


@triton.jit
def widen(x, DOT: tl.constexpr):
    """Cache values ``x`` as the dot dtype ``DOT``, exactly. int8 -> fp16 by the exponent trick:
    the byte with its sign bit flipped (``x + 128``) under fp16's exponent of 1024 is
    ``1024 + x + 128``; subtracting 1152 leaves x. Compiled, four codes at a time in one 32-bit
    register (``_widen_int8_fp16``: one xor, two byte permutes, two packed subtractions); the
    interpreter, which runs no PTX, takes the same steps value by value."""
    if x.dtype.is_int8() and DOT == tl.float16:
        if INTERPRET:  # widen_biased of the offset-binary bytes, minus its offset
            return widen_biased(x.to(tl.uint8, bitcast=True) ^ 0x80, DOT) - int8_offset(DOT)
        return _widen_int8_fp16(x)
    return x.to(DOT)


@triton.jit
def widen_biased(x, DOT: tl.constexpr):
    """Offset-binary bytes ``x`` (uint8, ``code + 128``: ``quant.k8v4_k_slots``) as ``DOT``, the
    codes plus ``int8_offset(DOT)``, exactly (fp16: ``1152 + code``, two byte permutes per four
    codes and no arithmetic), for a product whose offset is taken out once per result
    (``k8v4.page_k8v4``: per logit) rather than per code."""
    if DOT == tl.float16:
        if INTERPRET:
            return (x.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        return _widen_offset_binary_fp16(x)
    return ((x ^ 0x80).to(tl.int8, bitcast=True)).to(DOT)


@triton.jit
def int8_offset(DOT: tl.constexpr):
    """What ``widen_biased`` adds to every int8 code in ``DOT``: 1152 in fp16, else 0."""
    if DOT == tl.float16:
        return 1152.0
    return 0.0


@triton.jit
def _widen_offset_binary_fp16(x):
    """Offset-binary bytes -> fp16 ``1024 + byte`` four per instance: the bytes interleaved with
    0x64 (``prmt``)."""
    return tl.inline_asm_elementwise(
        "{ prmt.b32 $0, $2, 0x64646464, 0x4140; prmt.b32 $1, $2, 0x64646464, 0x4342; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _widen_int8_fp16(x):
    """int8 -> fp16 four codes per instance: ``t = x ^ 0x80808080`` (each byte + 128), bytes of t
    interleaved with 0x64 (``prmt``: fp16 ``1024 + byte``), minus 1152 (0x6480) two at a time."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, lo, hi, c; mov.b32 c, 0x64806480; xor.b32 t, $2, 0x80808080; "
        "prmt.b32 lo, t, 0x64646464, 0x4140; prmt.b32 hi, t, 0x64646464, 0x4342; "
        "sub.rn.f16x2 $0, lo, c; sub.rn.f16x2 $1, hi, c; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def weights(pr, v_scales, SCALES: tl.constexpr):
    """The ``p @ v`` operand: the softmax weights ``pr`` [BLOCK_G, PAGE], each column times its
    token's v scale where the cache has per-token scales (``SCALES``)."""
    w = pr
    if SCALES:
        w = pr * v_scales[None, :]
    return w


@triton.jit
def attend(
    q, kv_desc, table, p_begin, p_end, kh, lo, seq_len, qk_scale_log2, soft_cap, scale_ptr,
    BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, STAGES: tl.constexpr,
    PPI: tl.constexpr, USE_SOFT_CAP: tl.constexpr, DOT: tl.constexpr, LAZY: tl.constexpr,
    KH: tl.constexpr, SCALES: tl.constexpr, PV_SCALE: tl.constexpr,
):  # fmt: skip
    """Pages ``[p_begin, p_end)`` of one sequence's table for kv head ``kh`` (cache columns
    ``kh * D``), ``PPI`` per iteration and ``STAGES`` iterations in flight: (acc [BLOCK_G, D] fp32
    unnormalised with the columns of ``acc_cols``, running max, running sum), base 2. ``SCALES``:
    per-(token, head) scales at ``scale_ptr`` (``page_logits``); acc then carries ``PV_SCALE``."""
    col = kh * D
    offs_t = tl.arange(0, PAGE)
    # LAZY: m_i is a reference max moved only when some row's max grew by more than 8 (base 2),
    # as FlashAttention-4 does: p <= 2^8 (exact in fp16), and most iterations skip rescaling acc.
    # It starts finite so that fully masked rows give p = 0, not NaN.
    m_i = tl.full([BLOCK_G], -1e30 if LAZY else float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    n_iter = (p_end - p_begin + PPI - 1) // PPI
    for it in tl.range(0, n_iter, num_stages=STAGES):  # PPI pages per iteration, one softmax update
        p = p_begin + it * PPI
        s0, v0, vs0 = page_logits(
            q, kv_desc, table, p, p_end, col, lo, seq_len, qk_scale_log2, soft_cap,
            offs_t, scale_ptr, kh, PAGE, D, DOT, USE_SOFT_CAP, KH, SCALES, PV_SCALE,
        )  # fmt: skip
        m_blk = tl.max(s0, axis=1)
        if PPI >= 2:
            s1, v1, vs1 = page_logits(
                q, kv_desc, table, p + 1, p_end, col, lo, seq_len, qk_scale_log2, soft_cap,
                offs_t, scale_ptr, kh, PAGE, D, DOT, USE_SOFT_CAP, KH, SCALES, PV_SCALE,
            )  # fmt: skip
            m_blk = tl.maximum(m_blk, tl.max(s1, axis=1))
        if PPI >= 4:
            s2, v2, vs2 = page_logits(
                q, kv_desc, table, p + 2, p_end, col, lo, seq_len, qk_scale_log2, soft_cap,
                offs_t, scale_ptr, kh, PAGE, D, DOT, USE_SOFT_CAP, KH, SCALES, PV_SCALE,
            )  # fmt: skip
            s3, v3, vs3 = page_logits(
                q, kv_desc, table, p + 3, p_end, col, lo, seq_len, qk_scale_log2, soft_cap,
                offs_t, scale_ptr, kh, PAGE, D, DOT, USE_SOFT_CAP, KH, SCALES, PV_SCALE,
            )  # fmt: skip
            m_blk = tl.maximum(m_blk, tl.maximum(tl.max(s2, axis=1), tl.max(s3, axis=1)))
        m_new = tl.maximum(m_i, m_blk)
        if LAZY:
            if tl.max(m_new - m_i, axis=0) > 8.0:
                alpha = tl.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            m_safe = m_i
        else:
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        pr = tl.exp2(s0 - m_safe[:, None])
        l_i += tl.sum(pr, axis=1)
        acc = tl.dot(weights(pr, vs0, SCALES).to(DOT), widen(v0, DOT), acc)
        if PPI >= 2:
            pr = tl.exp2(s1 - m_safe[:, None])
            l_i += tl.sum(pr, axis=1)
            acc = tl.dot(weights(pr, vs1, SCALES).to(DOT), widen(v1, DOT), acc)
        if PPI >= 4:
            pr = tl.exp2(s2 - m_safe[:, None])
            l_i += tl.sum(pr, axis=1)
            acc = tl.dot(weights(pr, vs2, SCALES).to(DOT), widen(v2, DOT), acc)
            pr = tl.exp2(s3 - m_safe[:, None])
            l_i += tl.sum(pr, axis=1)
            acc = tl.dot(weights(pr, vs3, SCALES).to(DOT), widen(v3, DOT), acc)
    return acc, m_i, l_i


@triton.jit
def acc_cols(D: tl.constexpr):
    """The head dim of each of ``attend``'s acc columns: column c holds
    d = 16 * (c % (D // 16)) + c // (D // 16) (V's permutation in ``page_logits``)."""
    offs_d = tl.arange(0, D)
    offs_d = (offs_d % (D // 16)) * 16 + offs_d // (D // 16)
    return offs_d


@triton.jit
def store_out(acc, l_i, o_ptrs, mask, out_scale):
    """The normalised output ``acc / l_i * out_scale`` at ``o_ptrs`` [BLOCK_G, D] where ``mask``."""
    o = acc * (out_scale / l_i)[:, None]
    tl.store(o_ptrs, o.to(o_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def store_part(acc, m_i, l_i, rows, mask, offs_d, part_o_ptr, part_lse_ptr, D: tl.constexpr):
    """A partial result for a log-sum-exp merge: normalised ``acc`` at ``part_o[rows, :]`` and its
    log-sum-exp (base 2; -inf for an empty part) at ``part_lse[rows]``, where ``mask`` [BLOCK_G]."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    tl.store(part_lse_ptr + rows, lse, mask=mask)
    o_ptrs = part_o_ptr + rows[:, None] * D + offs_d[None, :]
    tl.store(o_ptrs, acc / l_safe[:, None], mask=mask[:, None])


@triton.jit
def store_split(
    acc, m_i, l_i, b, split, heads, g_mask, offs_d, out_ptr, part_o_ptr, part_lse_ptr,
    out_scale, stride_ob, stride_oh,
    QH: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, DIRECT: tl.constexpr,
):  # fmt: skip
    """A split program's epilogue: ``acc`` [BLOCK_G, D] (fp32, unnormalised; column j is head dim
    ``offs_d[j]``), running max ``m_i`` and sum ``l_i`` (base 2). ``DIRECT`` (one split): the
    output, scaled by ``out_scale``; else the split's normalised partial output and log-sum-exp
    for ``_combine``."""
    if DIRECT:
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        store_out(acc, l_i, o_ptrs, g_mask[:, None], out_scale)
    else:
        rows = (b.to(tl.int64) * QH + heads) * NUM_SPLITS + split  # [B, QH, S] row
        store_part(acc, m_i, l_i, rows, g_mask, offs_d, part_o_ptr, part_lse_ptr, D)


@triton.jit
def _combine(
    part_o_ptr, part_lse_ptr, out_ptr, out_scale, stride_ob, stride_oh,
    QH: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """out[b, h] = the splits' partial outputs [B, QH, S, D] weighted by exp2 of their lse [B, QH,
    S] (base 2; a split that saw no token, lse -inf, weighs 0), times ``out_scale``."""
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
    """The argument checks the decode kernels share (ValueError naming ``fn`` and the bad one)."""
    for name, t in int_tensors.items():
        if t.dtype != torch.int32 or t.device != q.device:
            raise ValueError(
                f"{fn}: {name} must be int32 on {q.device}, got {t.dtype} on {t.device}"
            )
    for name, dt in dot_dtypes.items():
        if dt not in DOT_DTYPES:
            raise ValueError(f"{fn}: {name} must be one of {list(DOT_DTYPES)}, got {dt}")
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


@triton.jit
def v_offsets(t, c, is_v, page, s_row, s_col, W: tl.constexpr):
    """Where the code bytes of tokens at page offsets ``t`` [R] and byte columns ``c`` [C] sit, rows
    ``s_row`` and columns ``s_col`` apart: (a token part [R], a column part [C]) whose sum is each
    byte's offset; for 4-bit v codes (``is_v``) where ``v_layout.v_layout_applies`` (pages of
    ``page`` tokens a multiple of 16, ``W`` bytes a token a multiple of 32), at
    ``v_layout.v_positions``, else a token a row. The layout's byte ``h * 512 + g * 64 + w * 4``
    (the column's part) ``+ t' * 16 + j`` (the token's) never carries into the next row (at most
    ``W - 1`` within one), so the row and column split into the two parts and a tile's addresses
    cost one add per byte, as a token a row does."""
    if W % 32 == 0:
        on = is_v & (page % 16 == 0)
        i = c % (W // 8)
        a = (i // 4) * 512 + c // (W // 8) * 64 + (i % 4) * 4
        b = t % 16 // 4 * 16 + t % 4
        tok = tl.where(on, (t - t % 16 + b // W) * s_row + b % W * s_col, t * s_row)
        col = tl.where(on, a // W * s_row + a % W * s_col, c * s_col)
    else:
        tok = t * s_row
        col = c * s_col
    return tok, col


@triton.jit
def store_rounded(dst, y, mask):
    """fp32 y at ``dst`` in its element dtype, rounded to nearest even as aten's cast (the
    interpreter's bf16 cast truncates: there the rounding is done on the bits; finite values)."""
    if dst.dtype.element_ty == tl.float32:
        tl.store(dst, y, mask=mask)
    elif INTERPRET and dst.dtype.element_ty == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(dst.to(tl.pointer_type(tl.uint16)), bits.to(tl.uint16), mask=mask)
    else:
        tl.store(dst, y.to(dst.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
