"""Transform-coded 4-bit KV cache (``tc4_per_token_head``, format "tc4"): pure functions on tensors.

What: per (token, kv head), head size D (a multiple of 16), K and V are split into groups of
coordinates, each quantized on its own by the int4 mode's asymmetric MSE-clipped uniform math
(``quant.INT4_CLIP_RATIOS``, rounding half away from zero) with ``2**bits - 1`` steps, an fp16
scale and a zero-point byte per group (``quantize_group``):

- K arrives already in a calibrated basis (its coordinates sorted by weight, the group Hadamards
  folded in; done elsewhere), so here it is just a vector y [..., D]: ``K_PLAN``, y[:D/4] at 6
  bits, y[D/4:D/2] at 4 bits, y[D/2:] at 3 bits. No rotation here.
- V: ``V_PLAN``, each channel half rotated on its own (``rotation.rotate`` over D/2 channels), the
  first at 5 bits, the second at 4; dequantization un-rotates each half.

Bytes per (token, kv head): K D/2 codes + 9 aux (3 fp16 scales, 3 zero points); V D/2 codes +
D/16 (the 5-bit half's high-bit plane) + 6 aux; 151 in all at D 128 (``aux_width``: 15 + D/16).

The code rows are laid out for a decode that turns codes into fp16 MMA operands two at a time with
no shifts per code (``0x6400 | (lane & mask)`` as fp16 is ``1024 + code * 2^s`` while the masked
bits sit in a 16-bit lane's low 10): K's row is D/4 little-endian 16-bit lanes, lane i = ``A_i |
B_i << 6 | C_2i << 10 | C_2i+1 << 13`` (``pack_k_lanes``; C's two codes read after one shift of
the 32-bit word by 8); V's row byte j = ``h1_j & 15 | h2_j << 4`` (half 1's and half 2's channel
j: the int4 mode's two-nibble byte, one half a nibble), half 1's fifth bits a 1-bit plane in the
aux row (``fifth_bit_positions``: the decode's operand order; the ``AUX_*`` offsets).

Why: bits where the score is. In the calibrated basis K's coordinates carry unequal shares of
q . k, so the heavy quarter gets 6 bits and the light half 3; V's halves get 5 / 4 bits with
their own rotation. fp16 scales with a separate zero-point byte keep the aux small (3 bytes a
group) with the zero point exact.

Cache layout: ``kv_cache`` uint8 [pages, 2, page, KH, D/2] (slot 0: K code rows; slot 1: V's
bytes, at ``v_layout``'s positions where it applies), ``kv_aux`` uint8 [pages, KH, aux_width(D),
page]: per page and kv head one contiguous block, the records' fp16 slots as fp16 [8, page], then
the fifth-bit bytes as rows [D/16, page] (``aux_to_cache``; a token's bytes: ``aux_positions``).
"""

from __future__ import annotations

import functools

import torch

from torch_kvq.attention import quant, rotation
from torch_kvq.attention.v_layout import v_from_cache, v_to_cache
from torch_kvq.spec_modes import tc4_aux_width

Plan = tuple[tuple[float, int], ...]
K_PLAN: Plan = ((0.25, 6), (0.25, 4), (0.5, 3))  # (fraction of D, bits) along K's sorted basis
V_PLAN: Plan = ((0.5, 5), (0.5, 4))  # V's channel halves, each rotated on its own
# the fp16 value nearest 6.2e-5 (fp16's smallest normal is 6.1e-5: no subnormal scale); the
# floor is applied to fp16 values so the stored scale is exactly the one used
HALF_SCALE_MIN = float(torch.tensor(6.2e-5).half())

# a token's aux record (bytes): 8 little-endian fp16 slots, K's 3 scales, V's 2, then the zero
# points a byte each (K's 3, V's 2; the last byte 0), then V half 1's fifth bits (D/16 bytes).
# ``quantize_k`` / ``quantize_v`` return their sides' parts (K: scales, zero points; V: scales,
# zero points, fifth bits) as ``K_SIDE`` / ``V_SIDE`` bytes; ``join_aux`` interleaves them.
AUX_K_SCALES, AUX_V_SCALES, AUX_K_ZP, AUX_V_ZP, AUX_V_HIGH = 0, 6, 10, 13, 16
AUX_SLOTS = 8  # fp16 slots before the fifth bits
K_SIDE = 9  # bytes of ``quantize_k``'s side part (``v_side``: ``quantize_v``'s)


def v_side(d: int) -> int:
    """Bytes of ``quantize_v``'s side part at head size ``d``: 2 fp16 scales, 2 zero points,
    D/16 bytes of fifth bits."""
    return 6 + d // 16


def aux_width(d: int) -> int:
    """Bytes of one aux record (per token and kv head) at head size ``d`` (the spec's
    ``tc4_aux_width``, which sizes the layer's ``kv_scale``: one count)."""
    return tc4_aux_width(d)


def aux_to_cache(records: torch.Tensor) -> torch.Tensor:
    """Aux records of whole pages [pages, page, KH, W] -> as a cache holds them, uint8 [pages,
    KH, W, page]: per (page, kv head) one block, the 8 fp16 slots as fp16 [8, page] (a slot's
    tokens side by side), then the fifth-bit bytes as rows [D/16, page]; a decode reads a page's
    slots or bits of one kv head as one box."""
    pages, page, kh, w = records.shape
    slots = records[..., : 2 * AUX_SLOTS].contiguous().view(torch.float16)  # [.., 8]
    slots = slots.permute(0, 2, 3, 1).contiguous().view(torch.uint8)  # [pages, KH, 8, 2 page]
    bits = records[..., 2 * AUX_SLOTS :].permute(0, 2, 3, 1)
    return torch.cat((slots.reshape(pages, kh, 2 * AUX_SLOTS, page), bits), 2).contiguous()


def aux_from_cache(stored: torch.Tensor) -> torch.Tensor:
    """``aux_to_cache``'s inverse: uint8 [pages, KH, W, page] -> records [pages, page, KH, W]."""
    pages, kh, w, page = stored.shape
    slots = stored[:, :, : 2 * AUX_SLOTS].reshape(pages, kh, AUX_SLOTS, 2 * page)
    slots = slots.contiguous().view(torch.float16).permute(0, 3, 1, 2)  # [pages, page, KH, 8]
    slot_bytes = slots.contiguous().view(torch.uint8)
    return torch.cat((slot_bytes, stored[:, :, 2 * AUX_SLOTS :].permute(0, 3, 1, 2)), -1)


def aux_positions(offsets: torch.Tensor, w: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) [T, w] in a page's aux block [w, page] (``aux_to_cache``) of the record
    bytes of the tokens at page ``offsets`` [T]."""
    i = torch.arange(w, device=offsets.device)[None, :]
    t = offsets[:, None]
    flat = 2 * ((i // 2) * page + t) + i % 2  # a slot byte's place in the fp16 [8, page] rows
    in_slots = i < 2 * AUX_SLOTS
    return torch.where(in_slots, flat // page, i), torch.where(in_slots, flat % page, t)


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


# K lane fields: (shift, bits) of A (6-bit), B (4-bit), C's even and odd channels (3-bit)
K_LANE = ((0, 6), (6, 4), (10, 3), (13, 3))


def pack_k_lanes(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """K's group codes a, b [..., D/4] and c [..., D/2] (uint8) -> its code row [..., D/2]: D/4
    little-endian 16-bit lanes, lane i = ``a_i | b_i << 6 | c_2i << 10 | c_2i+1 << 13``."""
    parts = (a, b, c[..., 0::2], c[..., 1::2])
    lane = sum(p.to(torch.int32) << shift for p, (shift, _) in zip(parts, K_LANE))
    return torch.stack((lane & 255, lane >> 8), -1).flatten(-2).to(torch.uint8)


def unpack_k_lanes(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_k_lanes``' inverse: a K code row [..., D/2] -> (a, b, c) uint8."""
    pairs = row.to(torch.int32).unflatten(-1, (-1, 2))
    lane = pairs[..., 0] | (pairs[..., 1] << 8)
    a, b, c0, c1 = (((lane >> shift) & ((1 << bits) - 1)).to(torch.uint8) for shift, bits in K_LANE)
    return a, b, torch.stack((c0, c1), -1).flatten(-2)


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


_CPU = torch.device("cpu")


@functools.cache
def fifth_bit_positions(d: int, device: torch.device = _CPU) -> torch.Tensor:
    """[D/2] int64: where V half 1's channel c has its fifth bit among a token's D/16 bytes, as 8 *
    byte + bit. With U = D/16 and c = g U + i (g < 8): where U is a multiple of 4 (D of 64, 128,
    256: every head size the decode takes) bit 4 (g % 2) + i % 4 of byte 4 (i // 4) + g // 2, so
    that one aux row at four consecutive tokens holds the 16 bits of one lane's MMA operand words
    (``triton/tc4_aux.fifth_words``); else bit g of byte i. Made once per (d, ``device``) and
    shared (read-only): the eager write runs inside CUDA-graph captures, where a host copy per call
    cannot (built on the host and copied once, as ``v_layout``'s positions)."""
    u = d // 16
    c = torch.arange(d // 2)
    g, i = c // u, c % u
    if u % 4 == 0:
        return (8 * (4 * (i // 4) + g // 2) + 4 * (g % 2) + i % 4).to(device)
    return (8 * i + g).to(device)


def pack_fifth_bits(bits: torch.Tensor) -> torch.Tensor:
    """V half 1's fifth bits [..., D/2] (0 / 1) -> D/16 bytes at ``fifth_bit_positions``."""
    placed = torch.empty_like(bits)
    placed[..., fifth_bit_positions(2 * bits.shape[-1], bits.device)] = bits
    return pack_plane(placed, 1)


def unpack_fifth_bits(packed: torch.Tensor) -> torch.Tensor:
    """``pack_fifth_bits``' inverse: D/16 bytes -> [..., D/2] bits (uint8)."""
    pos = fifth_bit_positions(16 * packed.shape[-1], packed.device)
    return unpack_plane(packed, 1)[..., pos]


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
    return pack_k_lanes(a, b, c), torch.cat(
        (_scales_bytes([sa, sb, sc]), torch.stack((za, zb, zc), -1)), -1
    )


def dequantize_k(codes: torch.Tensor, aux_k: torch.Tensor) -> torch.Tensor:
    """``quantize_k``'s codes [..., D/2] and aux_k [..., 9] back to fp32 [..., D] (in the basis)."""
    d = codes.shape[-1] * 2
    check_head_size(d)
    groups = unpack_k_lanes(codes)
    scales, zps = _bytes_scales(aux_k[..., :6]), aux_k[..., 6:K_SIDE]
    return torch.cat(
        [dequantize_group(g, scales[..., i], zps[..., i]) for i, g in enumerate(groups)], -1
    )


def quantize_v(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [..., D] -> (codes uint8 [..., D/2], aux_v uint8 [..., 6 + D/16]): each half rotated
    on its own, then half 1 at 5 bits, half 2 at 4."""
    d = v.shape[-1]
    check_head_size(d)
    (c1, s1, z1), (c2, s2, z2) = (
        quantize_group(rotation.rotate(v[..., s:e]), bits) for s, e, bits in group_bounds(d, V_PLAN)
    )
    row = (c1 & 15) | (c2 << 4)
    aux = (_scales_bytes([s1, s2]), torch.stack((z1, z2), -1), pack_fifth_bits(c1 >> 4))
    return row, torch.cat(aux, -1)


def dequantize_v(codes: torch.Tensor, aux_v: torch.Tensor) -> torch.Tensor:
    """``quantize_v``'s codes [..., D/2] and aux_v [..., 6 + D/16] back to fp32 [..., D],
    each half dequantized and un-rotated."""
    d = codes.shape[-1] * 2
    check_head_size(d)
    c1 = (codes & 15) | (unpack_fifth_bits(aux_v[..., 6:]) << 4)
    c2 = codes >> 4
    scales, zps = _bytes_scales(aux_v[..., :4]), aux_v[..., 4:6]
    halves = [
        rotation.unrotate(dequantize_group(c, scales[..., i], zps[..., i]))
        for i, c in enumerate((c1, c2))
    ]
    return torch.cat(halves, -1)


def join_aux(aux_k: torch.Tensor, aux_v: torch.Tensor) -> torch.Tensor:
    """aux_k [..., 9] (3 fp16 scales' bytes, 3 zero points) and aux_v [..., 6 + D/16] (2 scales,
    2 zero points, fifth bits) -> the aux record [..., aux_width(D)] (the ``AUX_*`` offsets)."""
    pad = torch.zeros_like(aux_k[..., :1])
    parts = (aux_k[..., :6], aux_v[..., :4], aux_k[..., 6:9], aux_v[..., 4:6], pad, aux_v[..., 6:])
    return torch.cat(parts, -1)


def split_aux(aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``join_aux``'s inverse: an aux record [..., aux_width(D)] -> (aux_k, aux_v)."""
    k = torch.cat(
        (aux[..., AUX_K_SCALES : AUX_K_SCALES + 6], aux[..., AUX_K_ZP : AUX_K_ZP + 3]), -1
    )
    v_parts = (aux[..., AUX_V_SCALES : AUX_V_SCALES + 4], aux[..., AUX_V_ZP : AUX_V_ZP + 2])
    return k, torch.cat((*v_parts, aux[..., AUX_V_HIGH:]), -1)


def quantize_pages(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k (in its basis) and v [pages, page, KH, D] -> (kv_cache uint8 [pages, 2, page, KH, D/2],
    kv_aux uint8 [pages, KH, aux_width(D), page]), as a cache holds them (tests, kernels)."""
    kc, ak = quantize_k(k)
    vc, av = quantize_v(v)
    return torch.stack((kc, v_to_cache(vc)), 1), aux_to_cache(join_aux(ak, av))


def dequantize_pages(kv_cache: torch.Tensor, kv_aux: torch.Tensor) -> torch.Tensor:
    """tc4 cache pages (``quantize_pages``' layout) -> fp32 [pages, 2, page, KH, D]: slot 0 K
    (still in its basis), slot 1 V (un-rotated)."""
    d = kv_cache.shape[-1] * 2
    check_head_size(d)
    if kv_aux.shape[-2] != aux_width(d):
        raise ValueError(
            f"kv_aux rows are {kv_aux.shape[-2]} bytes, tc4 at D {d} needs {aux_width(d)}"
        )
    aux_k, aux_v = split_aux(aux_from_cache(kv_aux))  # [pages, page, KH, width]
    k = dequantize_k(kv_cache[:, 0], aux_k)
    return torch.stack((k, dequantize_v(v_from_cache(kv_cache[:, 1]), aux_v)), 1)
