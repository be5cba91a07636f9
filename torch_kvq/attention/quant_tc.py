"""Transform-coded 4-bit KV cache (``tc4_per_token_head``, format "tc4"): pure functions on tensors.

What: per (token, kv head), head size D (a multiple of 16), K and V are split into groups of
coordinates, each quantized on its own by the int4 mode's asymmetric MSE-clipped uniform math
(``quant.INT4_CLIP_RATIOS``, rounding half away from zero) with ``2**bits - 1`` steps, an fp16
scale and a zero-point byte per group (``quantize_group``):

- K arrives already in a calibrated basis (its coordinates sorted by weight, the group Hadamards
  folded in; done elsewhere), so here it is just a vector y [..., D]: ``K_PLAN``, y[:D/4] at 6
  bits, y[D/4:D/2] at 4 bits, y[D/2:] at 3 bits. No rotation here.
- V: ``V_PLAN``, each channel half rotated on its own (``quant.rotate`` over D/2 channels), the
  first at 5 bits, the second at 4; dequantization un-rotates each half.

Bytes per (token, kv head): K D/2 codes + 9 aux (3 fp16 scales, 3 zero points); V D/2 codes +
D/16 (the 5-bit half's high-bit plane) + 6 aux; 151 in all at D 128 (``aux_width``: 15 + D/16).
Every code is stored as 4-bit nibbles and / or 2-bit and 1-bit planes so a decode kernel reads
whole bytes (``k_row_fields``, ``v_row_fields``, the ``AUX_*`` offsets).

Why: bits where the score is. In the calibrated basis K's coordinates carry unequal shares of
q . k, so the heavy quarter gets 6 bits and the light half 3; V's halves get 5 / 4 bits with
their own rotation. fp16 scales with a separate zero-point byte keep the aux small (3 bytes a
group) with the zero point exact.

Cache layout: ``kv_cache`` uint8 [pages, 2, page, KH, D/2] (slot 0: K code rows, slot 1: V code
rows), ``kv_aux`` uint8 [pages, KH, aux_width(D), page] (``kv_aux[p, h, :, t]`` is token t's aux
row: a page's aux rows of one kv head contiguous, one field byte per row).
"""

from __future__ import annotations

import torch

from torch_kvq.attention import quant
from torch_kvq.spec import tc4_aux_width

Plan = tuple[tuple[float, int], ...]
K_PLAN: Plan = ((0.25, 6), (0.25, 4), (0.5, 3))  # (fraction of D, bits) along K's sorted basis
V_PLAN: Plan = ((0.5, 5), (0.5, 4))  # V's channel halves, each rotated on its own
# the fp16 value nearest 6.2e-5 (fp16's smallest normal is 6.1e-5: no subnormal scale); the
# floor is applied to fp16 values so the stored scale is exactly the one used
HALF_SCALE_MIN = float(torch.tensor(6.2e-5).half())

# aux row byte offsets: K's 3 fp16 scales, K's 3 zero points, V's 2 fp16 scales, V's 2 zero
# points, then V half 1's high-bit plane (D/16 bytes)
AUX_K_SCALES, AUX_K_ZP, AUX_K_WIDTH = 0, 6, 9
AUX_V_SCALES, AUX_V_ZP, AUX_V_HIGH = 9, 13, 15


def aux_width(d: int) -> int:
    """Bytes of one aux row (per token and kv head) at head size ``d`` (the spec's
    ``tc4_aux_width``, which sizes the layer's ``kv_scale``: one count)."""
    return tc4_aux_width(d)


def check_head_size(d: int) -> None:
    """ValueError unless ``d`` is a positive multiple of 16 (every plane fills whole bytes)."""
    if d <= 0 or d % 16:
        raise ValueError(f"tc4 needs a head size that is a multiple of 16, got {d}")


def group_bounds(d: int, plan: Plan) -> list[tuple[int, int, int]]:
    """(start, stop, bits) of each group of ``plan`` over ``d`` coordinates (as the study splits)."""
    out, start = [], 0
    for frac, bits in plan:
        n = round(d * frac)
        out.append((start, start + n, bits))
        start += n
    if start != d:
        raise ValueError(f"plan {plan!r} covers {start} of {d} channels")
    return out


def k_row_fields(d: int) -> dict[str, tuple[int, int]]:
    """Byte ranges of a K code row (D/2 bytes): A's low nibbles, B's nibbles, A's high 2 bits,
    C's low 2 bits, C's high bit (A, B, C: ``K_PLAN``'s 6-, 4- and 3-bit groups)."""
    u = d // 16
    return {
        "a_low": (0, 2 * u),
        "b": (2 * u, 4 * u),
        "a_high": (4 * u, 5 * u),
        "c_low": (5 * u, 7 * u),
        "c_high": (7 * u, 8 * u),
    }


def v_row_fields(d: int) -> dict[str, tuple[int, int]]:
    """Byte ranges of a V code row (D/2 bytes): half 1's low nibbles, half 2's nibbles (half 1's
    fifth bit sits in the aux row at ``AUX_V_HIGH``)."""
    return {"h1_low": (0, d // 4), "h2": (d // 4, d // 2)}


def pack_plane(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values < 2**bits [..., n] -> [..., n * bits / 8] bytes; value j at bit bits * (j %
    (8 / bits)) of byte j // (8 / bits) (nibbles: the even index low)."""
    per = 8 // bits
    c = codes.to(torch.uint8).unflatten(-1, (-1, per))
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (bits * i)
    return out


def unpack_plane(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack_plane``'s inverse: bytes [..., m] -> uint8 values [..., m * 8 / bits]."""
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(8 // bits)]
    return torch.stack(parts, -1).flatten(-2)


def _group_codes(
    y: torch.Tensor, levels: int, ratio: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes fp32 [..., n], scale used [...] (fp16 values), zp fp32 [...]) of y over its range
    (holding zero) shrunk by ``ratio``: the study's ``uniform_fake`` with ``half_scale``."""
    lo, hi = y.amin(-1).clamp(max=0.0) * ratio, y.amax(-1).clamp(min=0.0) * ratio
    scale = ((hi - lo) * (1.0 / levels)).clamp(min=quant.SCALE_FLOOR)
    scale = scale.half().float().clamp(min=HALF_SCALE_MIN)
    zp = quant.round_half_away(-lo / scale).clamp(0, levels)
    c = quant.round_half_away(y * torch.reciprocal(scale).unsqueeze(-1) + zp.unsqueeze(-1))
    return c.clamp(0, levels), scale, zp


def quantize_group(y: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y [..., n] -> (codes uint8 [..., n], scale fp16 [...], zp uint8 [...]): asymmetric uniform
    codes with ``2**bits - 1`` steps per row, the clip ratio of least squared error (the first on
    a tie) among ``quant.INT4_CLIP_RATIOS``."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    yf, levels = y.float(), 2**bits - 1
    codes = scale = zp = best = None
    for r in quant.INT4_CLIP_RATIOS:
        c, s, z = _group_codes(yf, levels, r)
        err = ((c - z.unsqueeze(-1)) * s.unsqueeze(-1) - yf).double().square().sum(-1)
        if best is None:
            codes, scale, zp, best = c, s, z, err
            continue
        better = err < best
        codes = torch.where(better.unsqueeze(-1), c, codes)
        scale, zp = torch.where(better, s, scale), torch.where(better, z, zp)
        best = torch.minimum(err, best)
    return codes.to(torch.uint8), scale.half(), zp.to(torch.uint8)


def dequantize_group(codes: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
    """``quantize_group``'s codes back to fp32: ``(code - zp) * scale``."""
    return (codes.float() - zp.float()[..., None]) * scale.float()[..., None]


def _scales_bytes(scales: list[torch.Tensor]) -> torch.Tensor:
    """fp16 scales (each [...]) -> their little-endian bytes [..., 2 * len(scales)]."""
    return torch.stack(scales, -1).contiguous().view(torch.uint8)


def _bytes_scales(b: torch.Tensor) -> torch.Tensor:
    """``_scales_bytes``' inverse: bytes [..., 2g] -> fp16 [..., g]."""
    return b.contiguous().view(torch.float16)


def quantize_k(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K in its basis, y [..., D] -> (codes uint8 [..., D/2], aux_k uint8 [..., 9])."""
    d = y.shape[-1]
    check_head_size(d)
    (a, sa, za), (b, sb, zb), (c, sc, zc) = (
        quantize_group(y[..., s:e], bits) for s, e, bits in group_bounds(d, K_PLAN)
    )
    planes = (pack_plane(a & 15, 4), pack_plane(b, 4), pack_plane(a >> 4, 2))
    row = torch.cat((*planes, pack_plane(c & 3, 2), pack_plane(c >> 2, 1)), -1)
    return row, torch.cat((_scales_bytes([sa, sb, sc]), torch.stack((za, zb, zc), -1)), -1)


def dequantize_k(codes: torch.Tensor, aux_k: torch.Tensor) -> torch.Tensor:
    """``quantize_k``'s codes [..., D/2] and aux_k [..., 9] back to fp32 [..., D] (in the basis)."""
    d = codes.shape[-1] * 2
    check_head_size(d)
    f = k_row_fields(d)
    field = {k: codes[..., s:e] for k, (s, e) in f.items()}
    a = unpack_plane(field["a_low"], 4) | (unpack_plane(field["a_high"], 2) << 4)
    c = unpack_plane(field["c_low"], 2) | (unpack_plane(field["c_high"], 1) << 2)
    scales = _bytes_scales(aux_k[..., AUX_K_SCALES:AUX_K_ZP])
    zps = aux_k[..., AUX_K_ZP:AUX_K_WIDTH]
    groups = (a, unpack_plane(field["b"], 4), c)
    return torch.cat(
        [dequantize_group(g, scales[..., i], zps[..., i]) for i, g in enumerate(groups)], -1
    )


def quantize_v(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [..., D] -> (codes uint8 [..., D/2], aux_v uint8 [..., 6 + D/16]): each half rotated
    on its own, then half 1 at 5 bits, half 2 at 4."""
    d = v.shape[-1]
    check_head_size(d)
    (c1, s1, z1), (c2, s2, z2) = (
        quantize_group(quant.rotate(v[..., s:e]), bits) for s, e, bits in group_bounds(d, V_PLAN)
    )
    row = torch.cat((pack_plane(c1 & 15, 4), pack_plane(c2, 4)), -1)
    aux = (_scales_bytes([s1, s2]), torch.stack((z1, z2), -1), pack_plane(c1 >> 4, 1))
    return row, torch.cat(aux, -1)


def dequantize_v(codes: torch.Tensor, aux_v: torch.Tensor) -> torch.Tensor:
    """``quantize_v``'s codes [..., D/2] and aux_v [..., 6 + D/16] back to fp32 [..., D],
    each half dequantized and un-rotated."""
    d = codes.shape[-1] * 2
    check_head_size(d)
    f = v_row_fields(d)
    o = AUX_K_WIDTH  # aux_v's offsets are the aux row's less K's part
    high = unpack_plane(aux_v[..., AUX_V_HIGH - o :], 1)
    c1 = unpack_plane(codes[..., slice(*f["h1_low"])], 4) | (high << 4)
    c2 = unpack_plane(codes[..., slice(*f["h2"])], 4)
    scales = _bytes_scales(aux_v[..., AUX_V_SCALES - o : AUX_V_ZP - o])
    zps = aux_v[..., AUX_V_ZP - o : AUX_V_HIGH - o]
    halves = [
        quant.unrotate(dequantize_group(c, scales[..., i], zps[..., i]))
        for i, c in enumerate((c1, c2))
    ]
    return torch.cat(halves, -1)


def join_aux(aux_k: torch.Tensor, aux_v: torch.Tensor) -> torch.Tensor:
    """aux_k [..., 9] and aux_v [..., 6 + D/16] -> the aux row [..., aux_width(D)]."""
    return torch.cat((aux_k, aux_v), -1)


def split_aux(aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``join_aux``'s inverse: aux [..., aux_width(D)] -> (aux_k, aux_v)."""
    return aux[..., :AUX_K_WIDTH], aux[..., AUX_K_WIDTH:]


def quantize_pages(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k (in its basis) and v [pages, page, KH, D] -> (kv_cache uint8 [pages, 2, page, KH, D/2],
    kv_aux uint8 [pages, KH, aux_width(D), page]), as a cache holds them (tests, kernels)."""
    kc, ak = quantize_k(k)
    vc, av = quantize_v(v)
    return torch.stack((kc, vc), 1), join_aux(ak, av).permute(0, 2, 3, 1).contiguous()


def dequantize_pages(kv_cache: torch.Tensor, kv_aux: torch.Tensor) -> torch.Tensor:
    """tc4 cache pages (``quantize_pages``' layout) -> fp32 [pages, 2, page, KH, D]: slot 0 K
    (still in its basis), slot 1 V (un-rotated)."""
    d = kv_cache.shape[-1] * 2
    check_head_size(d)
    if kv_aux.shape[-2] != aux_width(d):
        raise ValueError(
            f"kv_aux rows are {kv_aux.shape[-2]} bytes, tc4 at D {d} needs {aux_width(d)}"
        )
    aux_k, aux_v = split_aux(kv_aux.permute(0, 3, 1, 2))  # [pages, page, KH, width]
    k = dequantize_k(kv_cache[:, 0], aux_k)
    return torch.stack((k, dequantize_v(kv_cache[:, 1], aux_v)), 1)
