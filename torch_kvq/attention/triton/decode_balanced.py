"""The balanced ("stream-K") schedule of the TMA decode kernel (``decode_tma``).

The split grid gives every (sequence, kv head) pair the same number of programs. When the pairs
are many (large batches of long sequences: 1-2 splits, thousands of one-warp programs) the
programs neither fill the SMs nor pack into whole waves. Here a fixed number of programs, all
resident at once, each take an equal run of the batch's pages: program i of P reads units
``[i * T // P, (i + 1) * T // P)`` of the T pages of all pairs laid end to end (sequence-major),
whatever the lengths; a run may end inside a pair and start the next. Per program at most two
pairs are cut (its first and its last), so there are two partial slots per program; a pair
wholly inside a run is written to the output by its program. ``_combine_balanced`` merges the cut
pairs (log-sum-exp). T and the runs are computed on the device from ``seq_lens``, so the launch
is CUDA-graph capturable like the split grid. Where it beats the split grid (large batches at
head 128; never at head 256) is measured in docs/design/fp8_decode_paths.md;
``decode_config.BALANCED`` picks it there.

Page loop and math are ``helpers.attend``, the TMA decode's; import only where Triton is.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from torch_kvq.attention.triton.decode_config import sm_count
from torch_kvq.attention.triton.helpers import (
    acc_cols,
    attend,
    load_q,
    split_outputs,
    store_out,
    store_part,
)
from torch_kvq.attention.triton.int4 import (
    store_lse,
    unrotate_store,
)
from torch_kvq.attention.triton.k8v4 import attend_4bit


@triton.jit
def _seq_work(seq_lens_ptr, window, B, KH: tl.constexpr, BLOCK_B: tl.constexpr,
              PAGE: tl.constexpr, USE_WINDOW: tl.constexpr):  # fmt: skip
    """The balanced schedule's work, in pages of every (sequence, kv head) pair, sequence-major:
    (offs_b [BLOCK_B], pages per pair n [BLOCK_B], end of each sequence's pairs ends [BLOCK_B],
    total). Pair (b, kh) is units ``[ends[b] - (KH - kh) * n[b], ends[b] - (KH - kh - 1) * n[b])``."""
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(seq_lens_ptr + offs_b, mask=offs_b < B, other=0)
    lo = tl.maximum(lens - window, 0) if USE_WINDOW else lens * 0
    n = (lens + PAGE - 1) // PAGE - lo // PAGE
    ends = tl.cumsum(n * KH, axis=0)
    return offs_b, n, ends, tl.sum(n * KH, axis=0)


@triton.jit
def _seq_base(offs_b, n, ends, b, KH: tl.constexpr):
    """Of ``_seq_work``'s arrays, sequence ``b``'s pages per pair and its first pair's first unit."""
    nb = tl.sum(tl.where(offs_b == b, n, 0), axis=0)
    return nb, tl.sum(tl.where(offs_b == b, ends, 0), axis=0) - nb * KH


@triton.jit
def _pair_of(unit, seq_lens_ptr, window, B, KH: tl.constexpr, BLOCK_B: tl.constexpr,
             PAGE: tl.constexpr, USE_WINDOW: tl.constexpr):  # fmt: skip
    """The pair holding work unit ``unit``: (sequence b, kv head, the pair's first unit, its
    pages). Recomputed from ``seq_lens`` per call (cached reads) rather than kept live across the
    page loop; the kernel's registers are held by ``max_registers`` (``BALANCED``), uncapped the
    same either way (``scripts/tma_kernel_sass.py --balanced --max-registers 0``)."""
    offs_b, n, ends, _ = _seq_work(seq_lens_ptr, window, B, KH, BLOCK_B, PAGE, USE_WINDOW)
    b = tl.sum((ends <= unit).to(tl.int32), axis=0)
    nb, base = _seq_base(offs_b, n, ends, b, KH)
    kh = (unit - base) // nb
    return b, kh, base + kh * nb, nb


@triton.jit
def _decode_balanced(
    q_ptr, kv_desc, block_table_ptr, seq_lens_ptr,
    part_o_ptr, part_lse_ptr, out_ptr, kv_scale_ptr, rot_ptr,
    qk_scale_log2, soft_cap, out_scale, window, B,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    KH: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_B: tl.constexpr,
    D: tl.constexpr, PAGE: tl.constexpr, STAGES: tl.constexpr, PPI: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, DOT: tl.constexpr, LAZY: tl.constexpr,
    SCALES: tl.constexpr, PV_SCALE: tl.constexpr, INT4: tl.constexpr, RSQRT_B: tl.constexpr,
    K8V4: tl.constexpr,
):  # fmt: skip
    """The balanced schedule ("stream-K"): program i of P takes units ``[i * T // P,
    (i + 1) * T // P)`` of all T pages of all pairs, so every program reads the same number of
    pages (+-1) whatever the lengths, and all P programs are resident at once (no tail wave). A
    pair wholly inside the range is written to the output; a pair cut by the range's start goes to
    partial slot 0 of the program, one cut by its end to slot 1 (``_combine_balanced``).
    ``kv_scale_ptr`` as ``decode_tma._decode_pages``'.
    ``INT4``: an int4 cache (``int4``; outputs and partials stored un-rotated, ``out_scale``
    applied to both); ``K8V4``: a k8v4 cache (``k8v4``: q not rotated, stored as int4's)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = _seq_work(seq_lens_ptr, window, B, KH, BLOCK_B, PAGE, USE_WINDOW)[3]
    start = (pid.to(tl.int64) * total // nprog).to(tl.int32)
    end = ((pid + 1).to(tl.int64) * total // nprog).to(tl.int32)
    first = start
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < G
    offs_d = acc_cols(D)
    while start < end:
        b, kh, pair_start, nb = _pair_of(
            start, seq_lens_ptr, window, B, KH, BLOCK_B, PAGE, USE_WINDOW
        )  # fmt: skip
        seg_end = tl.minimum(end, pair_start + nb)
        seq_len = tl.load(seq_lens_ptr + b)
        lo = tl.maximum(seq_len - window, 0) if USE_WINDOW else 0
        p0 = lo // PAGE + start - pair_start
        heads = kh * G + offs_g
        table = block_table_ptr + b.to(tl.int64) * stride_bt
        whole = (start == pair_start) & (seg_end == pair_start + nb)
        rows = (pid * 2 + tl.where(start == first, 0, 1)) * G + offs_g  # [P, 2, G] row
        if INT4 or K8V4:
            acc_lo, acc_hi, m_i, l_i = attend_4bit(
                q_ptr, b, heads, g_mask, stride_qb, stride_qh, rot_ptr, kv_desc, table, p0,
                p0 + seg_end - start, kh, lo, seq_len, qk_scale_log2, soft_cap, kv_scale_ptr,
                BLOCK_G, D, PAGE, STAGES, PPI, USE_SOFT_CAP, DOT, LAZY, PV_SCALE, RSQRT_B,
                K8V4,
            )  # fmt: skip
            store_lse(m_i, l_i, part_lse_ptr + rows, g_mask & ~whole)
            dst = out_ptr + b * stride_ob + heads * stride_oh
            unrotate_store(
                acc_lo, acc_hi, l_i, out_scale, rot_ptr, dst, g_mask & whole,
                part_o_ptr + rows * D, g_mask & ~whole, D, DOT, RSQRT_B, True,
            )  # fmt: skip
        else:
            q = load_q(q_ptr, b, heads, g_mask, tl.arange(0, D), stride_qb, stride_qh, DOT)
            acc, m_i, l_i = attend(
                q, kv_desc, table, p0, p0 + seg_end - start, kh, lo, seq_len, qk_scale_log2,
                soft_cap, kv_scale_ptr, BLOCK_G, D, PAGE, STAGES, PPI, USE_SOFT_CAP, DOT, LAZY,
                KH, SCALES, PV_SCALE,
            )  # fmt: skip
            o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            store_out(acc, l_i, o_ptrs, (g_mask & whole)[:, None], out_scale)
            store_part(acc, m_i, l_i, rows, g_mask & ~whole, offs_d, part_o_ptr, part_lse_ptr, D)
        start = seg_end


@triton.jit
def _combine_balanced(
    part_o_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, out_scale, window, B, nprog,
    stride_ob, stride_oh, KH: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_B: tl.constexpr, USE_WINDOW: tl.constexpr,
):  # fmt: skip
    """One program per (query head, sequence): a pair cut across programs p0..p1 (``p0 < p1``)
    merges p0's slot (0 if the pair starts p0's range, else 1) and slot 0 of p0 + 1 .. p1;
    a pair inside one program was written by it and is left alone."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    offs_b, n, ends, total = _seq_work(seq_lens_ptr, window, B, KH, BLOCK_B, PAGE, USE_WINDOW)
    nb, base = _seq_base(offs_b, n, ends, b, KH)
    g = h % G
    pair_start = (base + (h // G) * nb).to(tl.int64)
    t = tl.maximum(total, 1).to(tl.int64)
    p0 = ((pair_start + 1) * nprog - 1) // t  # the last program whose range starts at or before
    p1 = ((pair_start + nb) * nprog - 1) // t
    offs_d = tl.arange(0, D)
    m = -1e30
    w = 0.0
    acc = tl.zeros([D], tl.float32)
    for p in range(p0, p1 + 1):
        slot = tl.where((p == p0) & (p * t // nprog != pair_start), 1, 0)
        row = (p * 2 + slot) * G + g
        ran = p * t // nprog < (p + 1) * t // nprog  # with P > T some programs have no units
        lse = tl.load(part_lse_ptr + row, mask=ran, other=float("-inf"))
        m_new = tl.maximum(m, lse)
        scale = tl.exp2(m - m_new)
        wp = tl.exp2(lse - m_new)
        acc = acc * scale + wp * tl.load(part_o_ptr + row * D + offs_d, mask=ran, other=0.0)
        w = w * scale + wp
        m = m_new
    o = acc * (out_scale / w)
    o_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=(offs_d < D) & (p1 > p0))


def decode_balanced(
    q: torch.Tensor, desc: Any, block_table: torch.Tensor, seq_lens: torch.Tensor,
    scales: tuple[float, float, float, int], out: torch.Tensor | None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None, max_seq_len: int, programs_per_sm: int,
    kv_heads: int, page: int, common: dict[str, Any], kv_scale: torch.Tensor | None = None,
    rot: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``paged_decode_tma`` on the balanced schedule (its arguments checked there): ``desc`` the
    cache's TMA descriptor, ``kv_scale`` its per-(token, head) scales or None, ``rot`` an int4
    or k8v4 cache's rotation matrices (``int4.rotation_matrices``) or None, ``scales`` (logit scale, soft
    cap, out scale, window), ``common`` the kernel's shared constexprs and launch options.
    Returns out [B, QH, D]."""
    b, qh, d = q.shape
    g, window = qh // kv_heads, scales[3]
    out = split_outputs("paged_decode_tma", q, out, 1, None)[0]
    args = [q, desc, block_table, seq_lens, q, q, out, kv_scale, rot, *scales, b, q.stride(0),
            q.stride(1), out.stride(0), out.stride(1), block_table.stride(0)]  # fmt: skip
    kw = dict(KH=kv_heads, BLOCK_B=triton.next_power_of_2(b), **common)
    per_sm = programs_per_sm
    if q.is_cuda:  # never more than fit on an SM at once: a second wave would double the time
        per_sm = min(per_sm, _resident(args, kw))
    nprog = balanced_programs(q, kv_heads, max_seq_len, page, per_sm)
    part_o, part_lse = args[4:6] = _balanced_workspace(q, nprog, g, workspace)
    _decode_balanced[(nprog,)](*args, **kw)
    # int4 / k8v4 partials carry out_scale
    combine_scale = 1.0 if common["INT4"] or common["K8V4"] else scales[2]
    _combine_balanced[(qh, b)](
        part_o, part_lse, out, seq_lens, combine_scale, window, b, nprog, out.stride(0),
        out.stride(1),
        KH=kv_heads, G=g, D=d, PAGE=page, BLOCK_B=kw["BLOCK_B"], USE_WINDOW=common["USE_WINDOW"],
        num_warps=1,
    )  # fmt: skip
    return out


def resident_per_sm(kernel: Any) -> int:
    """Programs of a compiled kernel that an SM holds at once: by registers (64 Ki per SM, a
    warp's rounded up to 256), shared memory (1 KiB reserved per block) and 32 blocks."""
    kernel._init_handles()  # loads the binary: n_regs (Triton 3.x)
    props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
    warps = kernel.metadata.num_warps
    by_regs = 65536 // (-(-kernel.n_regs * 32 // 256) * 256 * warps)
    by_smem = (props["max_shared_mem"] + 1024) // (kernel.metadata.shared + 1024)
    return max(1, min(by_regs, by_smem, 32, 64 // warps))


def balanced_programs(
    q: torch.Tensor, kv_heads: int, max_seq_len: int, page: int, per_sm: int
) -> int:
    """The balanced schedule's program count: ``per_sm`` per SM (132 off CUDA), at most one per
    page of the batch's (sequence, kv head) pairs at ``max_seq_len``."""
    most = per_sm * sm_count(q.device)
    return max(1, min(most, q.shape[0] * kv_heads * -(-max_seq_len // page)))


def _balanced_workspace(
    q: torch.Tensor, nprog: int, g: int, workspace: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The balanced schedule's two partial slots per program: out [P, 2, G, D], lse [P, 2, G]."""
    d = q.shape[-1]
    if workspace is None:
        f32 = dict(dtype=torch.float32, device=q.device)
        return torch.empty((nprog, 2, g, d), **f32), torch.empty((nprog, 2, g), **f32)
    part_o, part_lse = workspace
    if part_o.shape != (nprog, 2, g, d) or part_lse.shape != (nprog, 2, g):
        raise ValueError(
            f"paged_decode_tma: workspace shapes {tuple(part_o.shape)} / {tuple(part_lse.shape)}: "
            f"the balanced schedule needs {(nprog, 2, g, d)} / {(nprog, 2, g)}"
        )
    return part_o, part_lse


_RESIDENT: dict[tuple, int] = {}


def _resident(args: list, kw: dict) -> int:
    """``resident_per_sm`` of ``_decode_balanced`` compiled for these arguments (cached)."""
    key = (torch.cuda.current_device(), tuple(sorted(kw.items())), args[0].dtype, args[6].dtype,
           args[1].base.dtype)  # fmt: skip
    if key not in _RESIDENT:
        probe = torch.empty(16, dtype=torch.float32, device=args[0].device)
        probe_args = [*args[:4], probe, probe, *args[6:]]
        _RESIDENT[key] = resident_per_sm(_decode_balanced.warmup(*probe_args, grid=(1,), **kw))
    return _RESIDENT[key]
