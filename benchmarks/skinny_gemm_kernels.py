"""Triton kernels of ``bench_skinny_gemm.py``: a split-K GEMM for few rows, and its reduction."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _splitk_mm(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """out tile [BLOCK_M, BLOCK_N] of x [M, K] @ w [N, K]^T over split ``program_id(1)``'s share
    of K: fp32 partials at ``out[split, m, n]`` (SPLIT_K > 1), else the result in out's dtype."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = split * per_split
    k_end = tl.minimum(k_begin + per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        ks = k + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
                    mask=(offs_m[:, None] < M) & (ks[None, :] < k_end), other=0.0)  # fmt: skip
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + ks[None, :],
                    mask=(offs_n[:, None] < N) & (ks[None, :] < k_end), other=0.0)  # fmt: skip
        acc = tl.dot(x, tl.trans(w), acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K > 1:
        ptrs = out_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask)
    else:
        ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_splits(part_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over splits of part[split, i] (fp32), in out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
