"""Quantization math, one home per cache format: pure functions on tensors.

The ops, the ``Attention`` layer, the kernels and the passes take the math from here, so the
fused kernels, the unfused eager form and the expression the passes match agree by
construction. A scale is the dequantization factor (``real ~= stored * scale``); which dtype a
mode stores is the spec's (``spec.FP8_DTYPE``).

FP8 per tensor (``KVQuantMode.FP8_PER_TENSOR``, e4m3): ``stored = clamp(x.float() / scale,
-FP8_MAX, FP8_MAX)`` cast to e4m3 (round to nearest even), ``real = stored.float() * scale``, one
static scale per layer for k and one for v.

Per (token, kv head) (``INT8_PER_TOKEN_HEAD`` / ``FP8_PER_TOKEN_HEAD``, vLLM's write semantics;
``mode`` "int8" / "fp8"): for each head vector of each token, k and v separately,
``scale = max(absmax(x.float()) / QMAX, 1e-6)`` (QMAX 127 / 448, fp32) and ``y = x.float() /
scale``; int8 rounds ``y`` half away from zero (``rounding="half_away"``, our op's) or half to even
(``"half_even"``, ``torch.round``, when the model wrote that), clamps to [-128, 127] and casts; fp8
clamps to +-448 and casts to e4m3 (round to nearest even). ``real = code.float() * scale``.
Computed once when the token is written, never revisited. In a paged cache the codes live in
``kv_cache`` [pages, 2, page, KH, D] and the scales in ``kv_scale`` [pages, 2, KH, page] fp32 (a
page's scales of one head contiguous). Every step is an exact or correctly rounded fp32 operation
except ``absmax / QMAX``, which aten computes per device (``kernels/kv_write.py`` reproduces it).
"""

from __future__ import annotations

from typing import Literal

import torch

from torch_kvq.spec import FP8_DTYPE

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
INT8_MAX = 127.0
SCALE_FLOOR = 1e-6  # the smallest per-(token, head) scale (vLLM's), so all-zero heads divide
# per-(token, head) format -> (code dtype, QMAX)
PER_TOKEN_HEAD_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, INT8_MAX),
    "fp8": (FP8_DTYPE, FP8_MAX),
}
Rounding = Literal["half_away", "half_even"]
ROUNDINGS = ("half_away", "half_even")


def quantize_fp8(
    x: torch.Tensor, scale: float | torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Static per-tensor FP8: ``clamp(x.float() / scale, -FP8_MAX, FP8_MAX)`` cast to e4m3.
    ``scale`` is a Python float or a 1-element float32 tensor (divided as aten divides by it).

    Traced, this is the torch-native static quant the passes match (``passes/quant_match.py``)
    and fuse. ``out`` (float8_e4m3fn, x's shape) receives the result: the same cast (``.to`` is
    a copy_), so the same bits, in ``out``'s layout instead of one that follows x's strides.
    """
    y = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
    return y.to(FP8_DTYPE) if out is None else out.copy_(y)


def dequantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """FP8 values back to real ones, in fp32: ``x.float() * scale``."""
    return x.float() * scale


def dequantize_fp8_kv_cache(kv_pages: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """FP8 cache pages [n, 2, page, KH, D] (K at ``[:, 0]``, V at ``[:, 1]``) dequantized in fp32:
    ``code.float() * scale``, never rounded to the model dtype (what the fused kernels read)."""
    scales = torch.tensor([k_scale, v_scale], dtype=torch.float32, device=kv_pages.device)
    return kv_pages.float() * scales.view(1, 2, 1, 1, 1)


def per_token_head_format(mode: str, rounding: str = "half_away") -> tuple[torch.dtype, float]:
    """(code dtype, QMAX) of a per-(token, head) ``mode`` ("int8" | "fp8"); ValueError naming a bad
    ``mode`` or ``rounding``."""
    if mode not in PER_TOKEN_HEAD_FORMATS:
        raise ValueError(
            f"unknown per-(token, head) format {mode!r}; expected one of {list(PER_TOKEN_HEAD_FORMATS)}"
        )
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; expected one of {list(ROUNDINGS)}")
    return PER_TOKEN_HEAD_FORMATS[mode]


def round_half_away(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``y`` to integers, ties away from zero, exactly: ``trunc(y)`` plus the sign where
    the fraction ``y - trunc(y)`` (exact in fp32) is at least one half. (``floor(|y| + 0.5)`` is not
    exact: 0.49999997 + 0.5 rounds to 1.)"""
    t = torch.trunc(y)
    return t + torch.where((y - t).abs() >= 0.5, torch.sign(y), 0.0)


def quantize_per_token_head(
    x: torch.Tensor, mode: str, rounding: Rounding = "half_away"
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] int8 / float8_e4m3fn, scales [...] fp32): one scale per head
    vector (the last dim), as the module docstring says. With ``rounding="half_even"`` the int8
    codes are those of the torch-native form a model writes (``.round()``)."""
    code_dtype, qmax = per_token_head_format(mode, rounding)
    xf = x.float()
    scales = (xf.abs().amax(-1, keepdim=True) / qmax).clamp(min=SCALE_FLOOR)
    y = xf / scales
    if code_dtype == torch.int8:
        r = round_half_away(y) if rounding == "half_away" else y.round()
        codes = r.clamp(-128, 127).to(torch.int8)
    else:
        codes = y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scales.squeeze(-1)


def dequantize_per_token_head(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., D] with scales [...] back to real values in fp32: ``codes.float() * scale``."""
    return codes.float() * scales.unsqueeze(-1)


def dequantize_pages_per_token_head(
    kv_cache: torch.Tensor, kv_scale: torch.Tensor, page_ids: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Pages ``page_ids`` [n] of a per-(token, head) cache (codes [pages, 2, page, KH, D], scales
    [pages, 2, KH, page]) dequantized into a compact [n, 2, page, KH, D] tensor of ``out_dtype``
    (fp32 values rounded once to it): page i of the result is cache page ``page_ids[i]``, so a page
    table over it counts 0..n-1."""
    ids = page_ids.long()
    scales = kv_scale[ids].transpose(-1, -2)  # [n, 2, page, KH]
    return dequantize_per_token_head(kv_cache[ids], scales).to(out_dtype)
