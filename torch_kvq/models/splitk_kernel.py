"""The Triton kernel of ``splitk.splitk_partials``. Triton is imported here, so import this module
only where Triton is installed (``splitk`` imports it on a CUDA call)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _splitk_mm(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """fp32 partial ``out[split, m, n]`` of x [M, K] @ w [N, K]^T over split ``program_id(1)``'s
    share of K (whole ``BLOCK_K`` tiles), for one [BLOCK_M, BLOCK_N] tile."""
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
    ptrs = out_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :]
    tl.store(ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def splitk_partials_triton(
    x: torch.Tensor, w: torch.Tensor, splits: int, block_n: int, block_k: int, stages: int
) -> torch.Tensor:
    """x [M, K], w [N, K] (rows contiguous) -> fp32 [splits, M, N]; programs over (N tiles, splits,
    M tiles of up to 128 rows), 4 warps each."""
    m, k = x.shape
    n = w.shape[0]
    block_m = max(16, min(128, triton.next_power_of_2(m)))
    out = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n), splits, triton.cdiv(m, block_m))
    _splitk_mm[grid](
        x, w, out, m, n, k, x.stride(0), w.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=splits, STAGES=stages,
        num_warps=4,
    )  # fmt: skip
    return out
