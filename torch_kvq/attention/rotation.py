"""The Hadamard rotation of 4-bit heads: ``R = H_b diag(signs) / sqrt(b)`` on each block of b
channels of a head vector.

b is the largest power of two dividing D (D itself for 64 / 128 / 256; 32 for 96; an odd D gets
b = 1: only the signs), H_b the Walsh-Hadamard matrix, signs a fixed +-1 vector per D (seeded, so
a cache written by one process is read by another). R is orthogonal: q . k = (R q) . (R k), and
attention over R v gives R (its output), undone by R^T. In fp32: signs, then the butterfly (log2 b
stages of a + b, a - b), then times fp32(b ** -0.5). The 4-bit formats (``quant``, ``quant_tc``)
rotate before they quantize; the kernels reproduce these operations in this order
(``triton/hadamard.py``).
"""

from __future__ import annotations

import functools

import torch

HADAMARD_SEED = 20261202


def hadamard_block(d: int) -> int:
    """The block size of the rotation of a head of ``d`` channels: the largest power of two
    dividing ``d`` (1 for odd ``d``: then the rotation is only the signs)."""
    if d <= 0:
        raise ValueError(f"head size must be positive, got {d}")
    return d & -d


def hadamard_signs(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed +-1 fp32 vector [d] of the rotation of ``d``-channel heads (seeded by ``d``)."""
    g = torch.Generator().manual_seed(HADAMARD_SEED + d)
    return (torch.randint(0, 2, (d,), generator=g) * 2 - 1).float().to(device)


@functools.cache
def signs_on(d: int, device: torch.device) -> torch.Tensor:
    """``hadamard_signs(d, device)``, made once per (d, device) and shared (read-only): the eager
    rotation and the kernels read it on every call, and a host-to-device copy per call cannot run
    while a CUDA graph is being captured."""
    return hadamard_signs(d, device)


def walsh_hadamard(x: torch.Tensor, b: int) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of each block of ``b`` channels of x [..., D] (fp32)."""
    shape = x.shape
    y = x.reshape(-1, shape[-1] // b, b)
    h = 1
    while h < b:
        y = y.view(y.shape[0], y.shape[1], b // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        y = y.reshape(y.shape[0], y.shape[1], b)
        h *= 2
    return y.reshape(shape)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``R x`` over the last dim, in fp32 (the module's rotation for ``x.shape[-1]`` channels)."""
    d = x.shape[-1]
    b = hadamard_block(d)
    return walsh_hadamard(x.float() * signs_on(d, x.device), b) * b**-0.5


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """``R^T y`` over the last dim, in fp32: ``unrotate(rotate(x)) == x`` up to fp32 rounding."""
    d = y.shape[-1]
    b = hadamard_block(d)
    return walsh_hadamard(y.float(), b) * b**-0.5 * signs_on(d, y.device)
