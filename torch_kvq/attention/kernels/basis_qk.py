"""The K-basis products of ``tc4_per_token_head`` layers (P k, P^-T q): what ``kvq.basis_qk``
runs. On CUDA one Triton launch for both (``attention/triton/basis_qk.py``), elsewhere the
einsums of ``k_basis.basis_qk``, whose result the program's equals but in near-ties (fp32 sums
in another order)."""

from __future__ import annotations

import torch

from torch_kvq.attention.k_basis import basis_qk, check_basis_operands
from torch_kvq.attention.kernels.launch import triton_program

BLOCK_M = 64  # rows (token, head) of a program
# (output columns, the matrix's columns a product step takes) of the 16-bit pair's tensor-core
# products and of fp32's FMA ones (smaller: larger tiles spill, offline sm90)
TILES = {True: (128, 64), False: (64, 16)}


def apply_basis(
    q: torch.Tensor, k: torch.Tensor, p: torch.Tensor, p_inv_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P^-T q, P k): q [T, H, D], k [T, KH, D], P and P^-T as ``k_basis.basis_operand`` made
    them. CUDA: ``apply_basis_triton``; elsewhere ``k_basis.basis_qk``."""
    if q.is_cuda:
        return apply_basis_triton(q, k, p, p_inv_t)
    qb, kb = basis_qk(q, k, p, p_inv_t)
    return qb.contiguous(), kb.contiguous()


def apply_basis_triton(
    q: torch.Tensor, k: torch.Tensor, p: torch.Tensor, p_inv_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_basis`` as one Triton launch (any device Triton runs on). ValueError as
    ``k_basis.check_basis_operands`` says, and for a head size not a multiple of 16."""
    pair = check_basis_operands(q, k, p, p_inv_t)
    t, h, d = q.shape
    kh = k.shape[1]
    if d % 16:
        raise ValueError(f"basis_qk: head size {d}: the Triton program needs a multiple of 16")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    p, p_inv_t = p.contiguous(), p_inv_t.contiguous()
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return qo, ko
    g = h // kh
    tile = d & -d  # the largest power of two dividing D: the program's tiles
    block_n, block_k = (min(tile, x) for x in TILES[pair])
    kernel = triton_program("basis_qk", "basis_qk_kernel", "the K-basis products")
    kernel[(-(-(t * g) // BLOCK_M), kh, 2)](
        q, k, p, p_inv_t, qo, ko, t, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        KH=kh, G=g, D=d, PAIR=pair, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=4,
    )  # fmt: skip
    return qo, ko
