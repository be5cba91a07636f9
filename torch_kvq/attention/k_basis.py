"""The K basis of ``tc4_per_token_head`` layers: the math of ``spec_channels.KBasis``, apply and
calibrate.

A 4-bit code per rotated coordinate spends the same bits on every coordinate, and the rotation
makes every coordinate's error the same size: right when every coordinate weighs the same in the
scores. They do not. With k' = T k and q' = T^-T q (so q' . k' = q . k) the score error of
coordinate i goes as E[q'_i^2] E[k'_i^2] 2^(-2 b_i). T is the balanced transform M (the error
model's optimum: M^T M = P with P C_k P = C_q, the matrix geometric mean of C_k^-1 and C_q, where
C_k and C_q are k's and q's second moments) followed by the eigenvectors of M C_k M^T in
descending order, so that both factors are sigma_i, sorted; the mode then spends 6 / 4 / 3 bits on
the first quarter / second quarter / last half of the coordinates (transform coding: bits where
the score is). Each group is rotated by its own Hadamard before its uniform codes (the error of a
group spread evenly over it); that rotation is folded into the basis here, P = R_groups T, so the
cache write and the decode see one matrix and no rotation of k.

The layer applies P to k and P^-T to q before its flow (``kvq.basis_qk``; ``basis_qk`` here is
its math): a batched matrix product per kv head (in the model's dtype where that is 16-bit: P as
two such matrices, ``basis_operand``, one product of twice the length). On CUDA the op runs both
products in one Triton launch (``kernels/basis_qk.py``).
"""

from __future__ import annotations

import torch

from torch_kvq.attention import quant_tc, rotation
from torch_kvq.spec_channels import KBasis


def basis_operand(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """P (or P^-T) [KH, D, D] float32 as ``basis_qk`` takes it in a model of ``dtype``, built once
    per layer: for bf16 / fp16 the pair [KH, D, 2D] of that dtype (P rounded, then the rest
    rounded: some 16 bits more than one), so that the products run on tensor cores as one of
    twice the length, accumulated in fp32 and rounded once; else P itself (fp32 products)."""
    if dtype in (torch.bfloat16, torch.float16):
        hi = p.to(dtype)
        return torch.cat((hi, (p - hi.float()).to(dtype)), -1)
    return p


def check_basis_operands(
    q: torch.Tensor, k: torch.Tensor, p: torch.Tensor, p_inv_t: torch.Tensor
) -> bool:
    """Whether P and P^-T are ``basis_operand``'s 16-bit pair (else fp32 matrices) for q [T, H,
    D] and k [T, KH, D]. ValueError for other shapes, or for a pair of another dtype than q's and
    k's."""
    t, h, d = q.shape
    kh = p.shape[0]
    if (
        tuple(k.shape) != (t, kh, d)
        or h % kh
        or p.shape != p_inv_t.shape
        or tuple(p.shape) not in ((kh, d, d), (kh, d, 2 * d))
    ):
        raise ValueError(
            f"basis_qk: q {tuple(q.shape)}, k {tuple(k.shape)}, P {tuple(p.shape)}, P^-T "
            f"{tuple(p_inv_t.shape)}: need q [T, H, D], k [T, KH, D] with H a multiple of KH, "
            "both matrices [KH, D, D] float32 or [KH, D, 2 D] (a 16-bit pair)"
        )
    if p.shape[-1] == d:
        return False
    if not q.dtype == k.dtype == p.dtype == p_inv_t.dtype:
        raise ValueError(
            f"basis_qk: the 16-bit basis pair is {p.dtype}, q {q.dtype} and k {k.dtype}: "
            "need one dtype (k_basis.basis_operand of the model's dtype)"
        )
    return True


def basis_qk(
    q: torch.Tensor, k: torch.Tensor, p: torch.Tensor, p_inv_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P^-T q, P k) in q's and k's dtypes. q [T, H, D], k [T, KH, D]; p and p_inv_t as
    ``basis_operand`` made them: [KH, D, D] float32 (fp32 products, any q and k), or the pair
    [KH, D, 2D] of q's and k's 16-bit dtype (x against both halves at once: the fp32 products'
    result rounded to that dtype but in near-ties, ``tests/attention/test_tc4_per_token_head.py``,
    at a 16-bit product's speed: fp32 ones run on the CUDA cores, over every prompt token). Query
    head h takes the matrix of kv head h // (H / KH). ValueError as ``check_basis_operands``
    says. The readable form; ``kvq.basis_qk`` runs one Triton launch on CUDA
    (``kernels/basis_qk.py``)."""
    pair = check_basis_operands(q, k, p, p_inv_t)
    t, h, d = q.shape
    kh = p.shape[0]
    qg = q.reshape(t, kh, h // kh, d)
    if pair:
        qb = torch.einsum("hde,thge->thgd", p_inv_t, torch.cat((qg, qg), -1))
        return qb.reshape(t, h, d), torch.einsum("hde,the->thd", p, torch.cat((k, k), -1))
    qb = torch.einsum("hde,thge->thgd", p_inv_t, qg.float())
    kb = torch.einsum("hde,the->thd", p, k.float())
    return qb.reshape(t, h, d).to(q.dtype), kb.to(k.dtype)


def _sqrtm(a: torch.Tensor) -> torch.Tensor:
    w, v = torch.linalg.eigh(a)
    return (v * w.clamp(min=0).sqrt().unsqueeze(-2)) @ v.transpose(-1, -2)


def balanced_transform(ck: torch.Tensor, cq: torch.Tensor) -> torch.Tensor:
    """M [KH, D, D] float64 from k's and q's second moments [KH, D, D] (float64): the error of a
    score after a uniform quantizer of M k goes as tr(M C_k M^T) tr(M^-T C_q M^-1), least at
    M^T M = P, P C_k P = C_q; M = P^1/2. Both moments get 1e-6 of their mean diagonal on the
    diagonal (channels that are 0 on every calibration token, as some of Gemma-3's)."""
    eye = torch.eye(ck.shape[-1], dtype=ck.dtype)
    ck = ck + 1e-6 * ck.diagonal(0, -2, -1).mean(-1)[:, None, None] * eye
    cq = cq + 1e-6 * cq.diagonal(0, -2, -1).mean(-1)[:, None, None] * eye
    r = _sqrtm(ck)
    r_inv = torch.linalg.inv(r)
    return _sqrtm(r_inv @ _sqrtm(r @ cq @ r) @ r_inv)


def sorted_eigvecs(m: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, sigma): the eigenvectors [KH, D, D] (columns) and eigenvalues [KH, D] of M C M^T,
    largest first."""
    w, u = torch.linalg.eigh(m @ c @ m.transpose(-1, -2))
    return u.flip(-1), w.flip(-1)


def sorted_basis(m: torch.Tensor, ck: torch.Tensor) -> torch.Tensor:
    """T = U^T M [KH, D, D] (``sorted_eigvecs``), so that T C_k T^T is diagonal and descending."""
    return sorted_eigvecs(m, ck)[0].transpose(-1, -2) @ m


def group_rotation(d: int) -> torch.Tensor:
    """R [D, D] float64: block-diagonal, ``rotation.rotate`` of each of K's groups
    (``quant_tc.K_PLAN``) on its own channels."""
    r = torch.zeros(d, d, dtype=torch.float64)
    for start, stop, _ in quant_tc.group_bounds(d, quant_tc.K_PLAN):
        n = stop - start
        # rotate acts on rows: rotate(I)[i] = R e_i, so R = rotate(I)^T
        r[start:stop, start:stop] = rotation.rotate(torch.eye(n)).double().T
    return r


class BasisStats:
    """Running second moments over calibration tokens of one layer: k k^T per kv head and q q^T
    over each kv head's query group, post-RoPE (what the ``Attention`` layer receives), float64."""

    def __init__(self) -> None:
        self.kk: torch.Tensor | float = 0.0
        self.qq: torch.Tensor | float = 0.0
        self.tokens = 0
        self.group = 0

    def add(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Add q [T, H, D] and k [T, KH, D]."""
        t, kh, d = k.shape
        qd = q.detach().double().cpu().reshape(t, kh, -1, d)
        kd = k.detach().double().cpu()
        self.kk = self.kk + torch.einsum("thd,the->hde", kd, kd)
        self.qq = self.qq + torch.einsum("thgd,thge->hde", qd, qd)
        self.tokens += t
        self.group = qd.shape[2]

    def basis(self) -> KBasis:
        """The layer's ``KBasis``: P = R_groups T (module docstring)."""
        if not self.tokens:
            raise ValueError("no calibration tokens were seen")
        ck = self.kk / self.tokens
        cq = self.qq / (self.tokens * self.group)
        t = sorted_basis(balanced_transform(ck, cq), ck)
        return KBasis.of(group_rotation(t.shape[-1]) @ t)


def inverse_transpose(p: torch.Tensor) -> torch.Tensor:
    """P^-T [KH, D, D] float32 of P [KH, D, D] (inverted in float64)."""
    return torch.linalg.inv(p.double()).transpose(-1, -2).float()


__all__ = [
    "BasisStats",
    "basis_operand",
    "basis_qk",
    "check_basis_operands",
    "inverse_transpose",
]
