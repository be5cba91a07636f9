"""A ``tc4_per_token_head`` layer's K-basis products (P k, P^-T q) in one Triton launch:
``basis_qk_kernel``, host side ``attention/kernels/basis_qk.py``, math ``k_basis.basis_qk``.

Each program takes a block of rows of one kv head's q (a row per (token, query head of the
group)) or of its k, and multiplies them by that kv head's matrix in blocks. A 16-bit model's
matrix is ``k_basis.basis_operand``'s pair [D, 2 D] (P rounded, then the rest): x against each
half on the tensor cores, both into one fp32 accumulator, rounded once, as the einsum over
``cat(x, x)`` is, without that concatenation's trip through memory. fp32 matrices take fp32
products (``input_precision="ieee"``, FMAs). Imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_kvq.attention.triton.helpers import INTERPRET, store_rounded


@triton.jit
def _rows_times(
    x_ptr, o_ptr, m_ptr, rows, pid_m, h, stride_t, stride_h, o_stride_t,
    G: tl.constexpr, D: tl.constexpr, PAIR: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Rows ``pid_m * BLOCK_M ..`` of kv head h's x (row r: token r // G, head h G + r % G) times
    its matrix: out[r, n] = sum_e m[n, e] x[r, e] (+ sum_e m[n, D + e] x[r, e] for a pair)."""
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = r < rows
    t = (r // G).to(tl.int64)
    head = h * G + r % G
    x_row = x_ptr + t * stride_t + head * stride_h
    o_row = o_ptr + t * o_stride_t + head * D
    W: tl.constexpr = 2 * D if PAIR else D
    m_head = m_ptr + h.to(tl.int64) * (D * W)
    for n0 in tl.static_range(0, D, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.static_range(0, D, BLOCK_K):
            e = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row[:, None] + e[None, :], mask=ok[:, None], other=0.0)
            m = m_head + n[None, :] * W + e[:, None]  # [BLOCK_K, BLOCK_N]: the matrix's transpose
            if INTERPRET:  # its bf16 products are not numpy's: fp32 ones of the same values
                acc = tl.dot(x.to(tl.float32), tl.load(m).to(tl.float32), acc)
                if PAIR:
                    acc = tl.dot(x.to(tl.float32), tl.load(m + D).to(tl.float32), acc)
            elif PAIR:
                acc = tl.dot(x, tl.load(m), acc)
                acc = tl.dot(x, tl.load(m + D), acc)
            else:
                acc = tl.dot(x, tl.load(m), acc, input_precision="ieee")
        store_rounded(o_row[:, None] + n[None, :], acc, ok[:, None])


@triton.jit
def basis_qk_kernel(
    q_ptr, k_ptr, p_ptr, pi_ptr, qo_ptr, ko_ptr, tokens,
    stride_qt, stride_qh, stride_kt, stride_kh,
    KH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Grid (row blocks of q's T G rows, KH, 2): axis 2 picks q (times P^-T, ``pi_ptr``) or k
    (times P); k's programs past its T rows return. Outputs contiguous [T, H, D]."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    if tl.program_id(2) == 0:
        _rows_times(
            q_ptr, qo_ptr, pi_ptr, tokens * G, pid_m, h, stride_qt, stride_qh, KH * G * D,
            G, D, PAIR, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
    elif pid_m * BLOCK_M < tokens:
        _rows_times(
            k_ptr, ko_ptr, p_ptr, tokens, pid_m, h, stride_kt, stride_kh, KH * D,
            1, D, PAIR, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
