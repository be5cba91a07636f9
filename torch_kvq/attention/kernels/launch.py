"""Host helpers the Triton launchers of ``attention/kernels/`` share: scalar operands as the
kernels see them (fp32), block sizes (powers of two) and the Triton programs themselves, imported
on first use: Triton is imported only there, only for CUDA, and none of this imports it.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from torch_kvq.attention.kernels.base import KernelUnsupportedError


def f32(x: float) -> float:
    """``x`` rounded to fp32 (a kernel's scalar operand), as a Python float."""
    return float(torch.tensor(x, dtype=torch.float32))


def next_pow2(n: int) -> int:
    """The smallest power of two at or above ``n`` (1 for ``n`` <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def triton_program(module: str, name: str, what: str) -> Any:
    """Program ``name`` of ``torch_kvq.attention.triton.<module>``, imported on first use;
    ``what`` (e.g. "the CUDA cache write") names the kernel in the KernelUnsupportedError raised
    when Triton cannot be imported."""
    try:
        programs = importlib.import_module(f"torch_kvq.attention.triton.{module}")
    except ImportError as e:  # torch's CUDA wheels ship Triton; a CUDA build without it cannot
        raise KernelUnsupportedError(
            f"{what} is a Triton kernel, and Triton cannot be imported ({e}); install triton (it "
            "comes with torch's CUDA wheels)"
        ) from e
    return getattr(programs, name)
