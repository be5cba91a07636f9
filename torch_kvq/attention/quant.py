"""Quantization math, one home per cache format: pure functions on tensors.

The ops, the ``Attention`` layer, the kernels and the passes take the math from here, so the
fused kernels, the unfused eager form and the expression the passes match agree by
construction. A scale is the dequantization factor (``real ~= stored * scale``); which dtype a
mode stores is the spec's (``spec_modes.FP8_DTYPE``).

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
except ``absmax / QMAX``, which aten computes per device (``kernels/kv_write_per_token_head.py``
reproduces it).

4-bit per (token, kv head) (``INT4_PER_TOKEN_HEAD``, ``mode`` "int4"): rotated, asymmetric,
MSE-clipped int4, two codes per byte (``quantize_int4_rotated`` / ``dequantize_int4_rotated``;
the sections at the end of this module); codes [pages, 2, page, KH, D / 2] uint8, the same
``kv_scale`` layout with each scale's zero point in its low mantissa bits. A page's 4-bit v codes
sit in a layout of their own (``v_layout``: the decode's operand words; a token a row unless the
page is a multiple of 16 tokens and D of 64).

k int8, v int4 (``K8V4_PER_TOKEN_HEAD``, layer format "k8v4"): k quantized as "int8", v as
"int4", each by its own math above; one uint8 cache [pages, 3, page, KH, D / 2] (slots 0 / 1: k's
int8 codes as bit patterns, channels 0..D/2-1 / D/2..D-1; slot 2: v's packed codes), the same
``kv_scale`` (k's int8 scale, v's int4 scale with its zero point). Section at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from torch_kvq.attention.rotation import rotate, unrotate
from torch_kvq.attention.v_layout import v_from_cache, v_to_cache
from torch_kvq.spec_modes import FP8_DTYPE

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
INT8_MAX = 127.0
SCALE_FLOOR = 1e-6  # the smallest per-(token, head) scale (vLLM's), so all-zero heads divide
# per-(token, head) format -> (code dtype, QMAX)
PER_TOKEN_HEAD_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, INT8_MAX),
    "fp8": (FP8_DTYPE, FP8_MAX),
    "int4": (torch.uint8, 15.0),  # INT4_PER_TOKEN_HEAD: rotated, asymmetric, MSE-clipped (below)
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
    codes are those of the torch-native form a model writes (``.round()``).

    ``mode="int4"`` is ``quantize_int4_rotated`` (packed codes [..., D / 2] uint8; ``rounding``
    does not apply: the int4 codes always round half away from zero)."""
    code_dtype, qmax = per_token_head_format(mode, rounding)
    if mode == "int4":
        return quantize_int4_rotated(x)
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
    table over it counts 0..n-1. A uint8 cache is ``int4_per_token_head``'s (codes [pages, 2,
    page, KH, D / 2]): ``dequantize_int4_pages``, back in the model's basis; or, with 3 slots,
    ``k8v4_per_token_head``'s (``dequantize_k8v4_pages``)."""
    ids = page_ids.long()
    scales = kv_scale[ids].transpose(-1, -2)  # [n, 2, page, KH]
    if kv_cache.shape[1] == 3:  # k8v4_per_token_head: k int8 in slots 0 / 1, v int4 in slot 2
        return dequantize_k8v4_pages(kv_cache[ids], scales).to(out_dtype)
    if kv_cache.dtype == torch.uint8:
        return dequantize_int4_pages(kv_cache[ids], scales).to(out_dtype)
    return dequantize_per_token_head(kv_cache[ids], scales).to(out_dtype)


def quantize_pages_per_token_head(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages of k and v [n, 2, page, KH, D] quantized per (token, head) in the layer format
    ``fmt`` ("int8" | "fp8" | "int4" | "k8v4") and laid out as a cache holds them: (codes [n,
    slots, page, KH, D or D / 2], scales [n, 2, page, KH]); what ``dequantize_pages_per_token_head``
    reads back (a cache built without the write op: tests, benchmarks)."""
    if fmt == "k8v4":
        return quantize_k8v4_pages(x)
    if fmt == "int4":
        return quantize_int4_pages(x)
    return quantize_per_token_head(x, fmt)


# -- 4-bit per (token, head), with a Hadamard rotation (issue 33: ``INT4_PER_TOKEN_HEAD``) --------
#
# Rotation: ``rotation.rotate`` (the rotation module), before the codes. Codes: per head vector,
# asymmetric over a range that holds zero (lo = min(min, 0), hi = max(max, 0), as torch.ao's
# observers; without it a head of equal values would have no range), ``scale = max((hi - lo) *
# fp32(1 / 15), 1e-6)`` (its 4 low bits then cleared), ``zp = clamp(round(-lo / scale), 0,
# 15)``, ``code = clamp(round(y * (1 / scale) + zp), 0, 15)`` (the reciprocal correctly rounded,
# each product and sum rounded to fp32 on its own); symmetric ``scale = max(absmax * fp32(1 / 7),
# 1e-6)``, zp = 8. Rounding half away from zero. The zero point rides in the scale's 4 low
# mantissa bits (vLLM's layout): the scale used everywhere is the fp32 value with those bits
# cleared. Two codes per byte: the even channel in the low nibble.

INT4_LEVELS = 15


def _with_zero_point(scale: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
    """fp32 ``scale`` with its 4 low mantissa bits replaced by ``zp`` (0..15)."""
    bits = scale.view(torch.int32) & ~0xF | zp.to(torch.int32)
    return bits.view(torch.float32)


def split_scale(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stored int4 scale -> (the scale used, its low bits cleared; the zero point, fp32)."""
    bits = stored.view(torch.int32)
    return (bits & ~0xF).view(torch.float32), (bits & 0xF).float()


def _int4_codes(
    xf: torch.Tensor, symmetric: bool, ratio: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [..., D] fp32, scale used [...], zp [...]) of fp32 ``xf`` over its range shrunk by
    ``ratio`` (1: the full range; the range still holds zero). Every step is one fp32 operation
    that rounds the same way on every device (products by Python floats, which aten and Triton
    take as fp32; a correctly rounded reciprocal; no division by a Python float, which aten's
    CUDA kernels turn into a product): ``triton/kv_write.py``'s int4 program repeats them."""
    if symmetric:
        scale = (xf.abs().amax(-1) * ratio * (1.0 / 7.0)).clamp(min=SCALE_FLOOR)
    else:
        lo, hi = xf.amin(-1).clamp(max=0.0) * ratio, xf.amax(-1).clamp(min=0.0) * ratio
        scale = ((hi - lo) * (1.0 / INT4_LEVELS)).clamp(min=SCALE_FLOOR)
    scale = (scale.view(torch.int32) & ~0xF).view(torch.float32)  # the scale used
    if symmetric:
        zp = torch.full_like(scale, 8.0)
    else:
        zp = round_half_away(-lo / scale).clamp(0, INT4_LEVELS)
    y = xf * torch.reciprocal(scale).unsqueeze(-1) + zp.unsqueeze(-1)
    return round_half_away(y).clamp(0, INT4_LEVELS), scale, zp


def _int4_sq_err(
    xf: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor
) -> torch.Tensor:
    """Squared error per row of the dequantized codes against ``xf``, summed in fp64 (each term
    exact there), so that two sums of the same terms in another order pick the same ratio."""
    d = (codes - zp.unsqueeze(-1)) * scale.unsqueeze(-1) - xf
    return d.double().square().sum(-1)


def quantize_int4_per_token_head(
    x: torch.Tensor, symmetric: bool = False, clip_ratios: Sequence[float] = (1.0,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (D even) -> (packed codes [..., D / 2] uint8, stored scales [...] fp32 with the
    zero point in their low bits), as the section's comment says. No rotation here: ``rotate``
    first for the rotated format.

    ``clip_ratios``: per-row MSE clipping at write time. The range (``[lo, hi]``, or ``absmax``
    symmetric) is shrunk by each ratio in turn and each row keeps the ratio whose dequantized
    values have the least squared error against ``x`` (the first on a tie); values outside a
    shrunk range clamp to the end codes. Still one scale and zero point per row. The default
    ``(1.0,)`` is the full range."""
    if x.shape[-1] % 2:
        raise ValueError(
            f"int4 packs two channels per byte: head size must be even, got {x.shape[-1]}"
        )
    if not clip_ratios or any(not 0.0 < r <= 1.0 for r in clip_ratios):
        raise ValueError(f"clip ratios must be in (0, 1], got {tuple(clip_ratios)}")
    xf = x.float()
    codes, scale, zp = _int4_codes(xf, symmetric, clip_ratios[0])
    if len(clip_ratios) > 1:
        best = _int4_sq_err(xf, codes, scale, zp)
        for r in clip_ratios[1:]:
            c, s, z = _int4_codes(xf, symmetric, r)
            err = _int4_sq_err(xf, c, s, z)
            better = err < best
            codes = torch.where(better.unsqueeze(-1), c, codes)
            scale, zp = torch.where(better, s, scale), torch.where(better, z, zp)
            best = torch.minimum(err, best)
    c = codes.to(torch.uint8)
    packed = c[..., 0::2] | (c[..., 1::2] << 4)
    return packed, _with_zero_point(scale, zp)


def dequantize_int4_per_token_head(packed: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Packed codes [..., D / 2] with stored scales [...] back to real values [..., D] in fp32:
    ``(code - zp) * scale`` (still in the rotated space if the codes were written rotated)."""
    scale, zp = split_scale(stored)
    lo, hi = (packed & 0xF).float(), (packed >> 4).float()
    codes = torch.stack((lo, hi), dim=-1).flatten(-2)
    return (codes - zp.unsqueeze(-1)) * scale.unsqueeze(-1)


def quantize_int4_grouped(
    x: torch.Tensor, group: int, symmetric: bool = False, clip_ratios: Sequence[float] = (1.0,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 with one scale and zero point per ``group`` channels of each head instead of per head
    (a diagnostic of the format's headroom; D / group scales per (token, head), each 4 bytes):
    x [..., D] -> (packed [..., D / 2] uint8, stored scales [..., D / group] fp32), each group
    quantized as ``quantize_int4_per_token_head`` quantizes a head."""
    d = x.shape[-1]
    if group <= 0 or group % 2 or d % group:
        raise ValueError(f"group must be even and divide the head size {d}, got {group}")
    packed, stored = quantize_int4_per_token_head(
        x.reshape(*x.shape[:-1], d // group, group), symmetric, clip_ratios
    )
    return packed.flatten(-2), stored


def dequantize_int4_grouped(packed: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """``quantize_int4_grouped``'s codes [..., D / 2] and scales [..., G] back to [..., D] fp32."""
    g = stored.shape[-1]
    y = dequantize_int4_per_token_head(packed.unflatten(-1, (g, -1)), stored)
    return y.flatten(-2)


# -- INT4_PER_TOKEN_HEAD ("int4"): the format docs/design/int4-branch.md chose ------------------
#
# Rotated, asymmetric, per-row MSE-clipped (the study's ``int4-rot-mse``, benchmarks/int4_study.py's
# CLIP_RATIOS). The eager / reference form rotates k and v at the write and un-rotates them after
# dequantization, so attention reads k and v in the model's basis; rotating q instead of
# un-rotating k (scores unchanged: R is orthogonal) and un-rotating the output instead of v is the
# same attention in exact arithmetic, and is what a fused kernel does to skip the per-key pass.

INT4_CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))  # 1.0, 0.95, .., 0.5


def quantize_int4_rotated(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``INT4_PER_TOKEN_HEAD``'s write: x [..., D] (D even) -> (packed codes [..., D / 2] uint8,
    stored scales [...] fp32 with the zero point in their low bits) of ``rotate(x)``, asymmetric,
    MSE-clipped over ``INT4_CLIP_RATIOS``."""
    return quantize_int4_per_token_head(rotate(x), clip_ratios=INT4_CLIP_RATIOS)


def dequantize_int4_rotated(packed: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """``INT4_PER_TOKEN_HEAD``'s read: packed codes [..., D / 2] with stored scales [...] back to
    [..., D] fp32 in the model's basis (dequantized, then ``unrotate``)."""
    return unrotate(dequantize_int4_per_token_head(packed, stored))


def quantize_int4_pages(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages of k and v [n, 2, page, KH, D] -> (codes uint8 [n, 2, page, KH, D / 2], v's in
    ``v_layout``'s positions; scales [n, 2, page, KH]): ``quantize_int4_rotated`` as a cache
    holds it."""
    codes, scales = quantize_int4_rotated(x)
    return torch.stack((codes[:, 0], v_to_cache(codes[:, 1])), 1), scales


def dequantize_int4_pages(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int4 cache pages, codes uint8 [..., 2, page, KH, D / 2] with scales [..., 2, page, KH], to
    fp32 [..., 2, page, KH, D] in the model's basis (``quantize_int4_pages``' inverse up to the
    quantization)."""
    k = dequantize_int4_rotated(codes.select(-4, 0), scales.select(-3, 0))
    v = dequantize_int4_rotated(v_from_cache(codes.select(-4, 1)), scales.select(-3, 1))
    return torch.stack((k, v), -4)


# -- K8V4_PER_TOKEN_HEAD ("k8v4"): k as "int8", v as "int4", in one uint8 cache -------------------
#
# The two formats' math is the functions above, unchanged; what is new is only where the codes
# sit: k's int8 codes [..., D] as uint8 bit patterns split over slots 0 and 1 ([..., D / 2] each),
# v's packed int4 codes in slot 2 (in ``v_layout``'s positions), so one uint8 tensor
# [pages, 3, page, KH, D / 2] holds both.

KV_FORMATS = {"k8v4": ("int8", "int4")}  # layer format -> (k's format, v's format)


def kv_formats(fmt: str) -> tuple[str, str]:
    """(k's format, v's format) of a per-(token, head) layer format: ``KV_FORMATS``'s pair, else
    ``fmt`` twice."""
    return KV_FORMATS.get(fmt, (fmt, fmt))


def cache_layout(fmt: str) -> tuple[torch.dtype, int, int]:
    """(code dtype, slots (the cache's dim 1), channels per element of its last dim) of a
    per-(token, head) layer format; ValueError for an unknown one."""
    if fmt in KV_FORMATS:
        return torch.uint8, 3, 2
    code_dtype, _ = per_token_head_format(fmt)
    return code_dtype, 2, 2 if fmt == "int4" else 1


def k8v4_k_slots(k_codes: torch.Tensor) -> torch.Tensor:
    """k's int8 codes [T, KH, D] as the uint8 contents of slots 0 and 1: [T, 2, KH, D / 2], each
    byte offset binary (``code + 128``, the sign bit flipped): under fp16's exponent of 1024 a
    byte is ``1152 + code`` with no arithmetic (``triton/helpers.widen_biased``)."""
    return (k_codes.view(torch.uint8) ^ 0x80).unflatten(-1, (2, -1)).movedim(-2, 1)


def k8v4_k_codes(slots: torch.Tensor) -> torch.Tensor:
    """Slots 0 and 1 of cache pages, uint8 [n, 2, page, KH, D / 2], back to k's int8 codes
    [n, page, KH, D] (``k8v4_k_slots``'s inverse)."""
    return (slots.movedim(1, -2).flatten(-2) ^ 0x80).view(torch.int8)


def quantize_k8v4_pages(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages of k and v [n, 2, page, KH, D] (D even) -> (codes uint8 [n, 3, page, KH, D / 2],
    scales [n, 2, page, KH]) laid out as the k8v4 write lays them (``dequantize_k8v4_pages``'
    inverse up to the quantization)."""
    kc, ks = quantize_per_token_head(x[:, 0], "int8")
    vc, vs = quantize_int4_rotated(x[:, 1])
    return torch.cat((k8v4_k_slots(kc), v_to_cache(vc).unsqueeze(1)), 1), torch.stack((ks, vs), 1)


def dequantize_k8v4_pages(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """k8v4 cache pages, codes uint8 [n, 3, page, KH, D / 2] with scales [n, 2, page, KH], to fp32
    [n, 2, page, KH, D]: k ``dequantize_per_token_head``, v ``dequantize_int4_rotated``."""
    k = dequantize_per_token_head(k8v4_k_codes(codes[:, :2]), scales[:, 0])
    v = dequantize_int4_rotated(v_from_cache(codes[:, 2]), scales[:, 1])
    return torch.stack((k, v), 1)
