"""Transform coding of K (and V) for ``kv_format_study.py``: a calibrated basis in which the
coordinates' weighted variances are sorted, then more bits on the coordinates that carry more of
the score (issue 33; docs/accuracy.md, "Bits where the score is"). A study, CPU only.

The int4 mode spends 4 bits on every rotated coordinate. The rotation makes every coordinate's
error the same size, which is right when every coordinate weighs the same; K's do not. With
q' = T^-T q and k' = T k (q' . k' = q . k), the score error of coordinate i goes as
E[q'_i^2] E[k'_i^2] 2^(-2 b_i); with T the balanced basis of ``kv_formats.k_transform``
(M, so that M C_k M^T = M^-T C_q M^-1) followed by that matrix's eigenvectors, both factors are
sigma_i, and spending b_i ~ log2(sigma_i) bits (at the same mean) divides the error by
AM(sigma)^2 / GM(sigma)^2 over the same basis at uniform bits (classic transform coding; the
spectrum is printed by ``spectrum``). V's error reaches the residual stream through o_proj, so
V's basis balances C_v against G = sum over the kv head's query heads of W_o,h^T W_o,h.

A plan is a tuple of (fraction of D, bits) groups along the sorted coordinates; each group is
rotated by its own Hadamard and quantized per (token, kv head, group) by the int4 mode's clipped
asymmetric uniform math with 2^bits - 1 steps (``kv_formats.uniform_fake``), 0 bits drops
the group. Bytes per (token, kv head): sum(fraction * bits) * D / 8 of codes plus one scale and
zero point per group (the int4 mode: one fp32 with the zero point in its low bits).
Formats (per layer, "fmt:layer"). K: ``tc<plan>`` the full basis, ``tcd<plan>`` a diagonal one
(the K channel scales' s, channels sorted by their balanced variance: no matrix in a kernel),
``tcw<NNN>`` the full basis with bits water-filled per kv head (``water_fill``, NNN / 100 bits a
coordinate), ``tch<plan>`` as tc with fp16 group scales. V: ``tcv<plan>``, ``tcvh<plan>`` (fp16);
``tcvi<plan>`` / ``tcvih<plan>`` V's channels in their own order (no calibrated basis: each
group, a run of channels, rotated by its own Hadamard), which basis the groups' bits take
mattering or not.
"""

from __future__ import annotations

import torch

from torch_kvq.attention import k_basis, rotation

# mean 4 bits a coordinate ("4": one group, the basis alone) unless said
PLANS: dict[str, tuple[tuple[float, int], ...]] = {
    "643": ((0.25, 6), (0.25, 4), (0.5, 3)),
    "53": ((0.5, 5), (0.5, 3)),
    "6442": ((0.25, 6), (0.5, 4), (0.25, 2)),
    "4": ((1.0, 4),),
    "753": ((0.125, 7), (0.375, 5), (0.5, 3)),
    # below 4 bits a coordinate: room for 5-bit V in the 3.3x capacity budget
    "543": ((0.25, 5), (0.25, 4), (0.5, 3)),
    "533": ((0.25, 5), (0.75, 3)),
    # above: V's 4.75 / 4.5 bits a coordinate in its own basis
    "5554": ((0.75, 5), (0.25, 4)),
    "54": ((0.5, 5), (0.5, 4)),
}
K_KINDS = ("tc", "tcd", "tcw", "tch")  # "h": fp16 group scales and a zero-point byte
V_KINDS = ("tcv", "tcvh", "tcvi", "tcvih")  # "i": the identity basis (no calibration)
# relative squared error of a rotated group at b bits per coordinate, b = 0..8 (0: dropped)
REL_ERR = (1.0, 0.45, 0.14, 0.04, 0.0105, 0.0027, 0.0007, 0.00018, 0.000045)
BLOCK = 8  # tcw spends bits on blocks of this many sorted coordinates
# tcw's plans per (layer, mean bits x 100): one per kv head, as PLANS' tuples
WATER: dict[tuple[int, int], list[tuple[tuple[float, int], ...]]] = {}
# basis per (kind without "h" / "w", layer): (T [KH, D, D], T^-1 [KH, D, D]) fp32
BASES: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
# (both filled by ``kv_formats.transform_bases`` from the calibration split)


def split_format(fmt: str) -> tuple[str, str] | None:
    """(kind of ``K_KINDS`` / ``V_KINDS``, plan name) of a transform-coding format name, else
    None."""
    if fmt.startswith("tcw") and fmt[3:].isdigit() and len(fmt) == 6:
        return "tcw", fmt[3:]
    for kind in sorted(K_KINDS + V_KINDS, key=len, reverse=True):
        if fmt.startswith(kind) and fmt[len(kind) :] in PLANS:
            return kind, fmt[len(kind) :]
    return None


def water_fill(sigma: torch.Tensor, mean_bits: float) -> tuple[tuple[float, int], ...]:
    """A plan for one kv head: greedy bits on blocks of ``BLOCK`` sorted coordinates (sigma [D],
    descending), each bit to the block whose score error it lowers most (block weight: the sum
    of sigma_i^2, error w * REL_ERR[b]), until mean_bits * D bits; equal neighbours merge."""
    d = sigma.shape[0]
    w = sigma.double().square().reshape(d // BLOCK, BLOCK).sum(-1)
    bits = [0] * (d // BLOCK)
    for _ in range(round(mean_bits * d / BLOCK)):
        gain = [w[j] * (REL_ERR[b] - REL_ERR[b + 1]) if b < 8 else -1.0 for j, b in enumerate(bits)]
        j = max(range(len(bits)), key=lambda j: gain[j])
        bits[j] += 1
    plan: list[list] = []
    for b in bits:
        if plan and plan[-1][1] == b:
            plan[-1][0] += BLOCK / d
        else:
            plan.append([BLOCK / d, b])
    return tuple((f, b) for f, b in plan)


def sorted_basis(m: torch.Tensor, m_inv: torch.Tensor, c: torch.Tensor) -> tuple:
    """(T, T^-1, sigma) [KH, D, D], [KH, D, D], [KH, D]: M followed by the eigenvectors of
    M C M^T (descending), so that T C T^T = diag(sigma)."""
    m, m_inv, c = m.double(), m_inv.double(), c.double()
    u, w = k_basis.sorted_eigvecs(m, c)
    return (u.transpose(-1, -2) @ m).float(), (m_inv @ u).float(), w


def diag_basis(s: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, T^-1): k / s (``s`` [KH, D], the K channel scales) with the channels sorted by their
    second moment after the scaling (``c`` [KH, D, D], k's), largest first."""
    s = s.double()
    var = c.diagonal(0, -2, -1).double() / s.square()
    order = var.argsort(-1, descending=True)
    kh, d = s.shape
    t = torch.zeros(kh, d, d, dtype=torch.float64)
    for h in range(kh):
        t[h, torch.arange(d), order[h]] = 1.0 / s[h, order[h]]
    return t.float(), torch.linalg.inv(t).float()


def o_proj_metric(w: torch.Tensor, kh: int, d: int) -> torch.Tensor:
    """G [KH, D, D]: sum over each kv head's query heads h of W_o,h^T W_o,h, ``w`` o_proj's weight
    [hidden, H * D] (query head h's columns h * D .. (h + 1) * D)."""
    h = w.shape[1] // d
    wh = w.double().reshape(w.shape[0], kh, h // kh, d)
    return torch.einsum("okgd,okge->kde", wh, wh)


def plan_bytes(plan: str, d: int) -> float:
    """Code bytes per (token, kv head) of ``plan`` at head size ``d`` (scales not counted)."""
    return sum(f * b for f, b in PLANS[plan]) * d / 8


def alloc_fake(x: torch.Tensor, fmt: str, layer: int, uniform_fake) -> torch.Tensor:
    """x [T, KH, D] through ``fmt`` (a ``split_format`` name) of ``layer`` and back."""
    kind, plan = split_format(fmt)
    half = kind.endswith("h")  # an fp16 scale and a zero-point byte per group: 3 bytes, not 4
    kind = kind.removesuffix("h")
    if kind == "tcvi":
        t = t_inv = torch.eye(x.shape[-1]).expand(x.shape[1], -1, -1)
    else:
        t, t_inv = BASES[("tc" if kind == "tcw" else kind, layer)]
    y = torch.einsum("hde,the->thd", t, x.float())
    out = torch.zeros_like(y)
    d = y.shape[-1]
    # (kv heads, plan): tcw's differ per head, a named plan serves every head in one pass
    if kind == "tcw":
        plans = list(enumerate(WATER[(layer, int(plan))]))
    else:
        plans = [(slice(None), PLANS[plan])]
    for heads, groups in plans:
        start = 0
        for frac, bits in groups:
            n = round(d * frac)
            if bits:
                g = rotation.rotate(y[:, heads, start : start + n])
                out[:, heads, start : start + n] = rotation.unrotate(
                    uniform_fake(g, 2**bits - 1, half)
                )
            start += n
        if start != d:
            raise ValueError(f"plan {groups!r} covers {start} of {d} channels")
    return torch.einsum("hde,the->thd", t_inv, out).to(x.dtype)


def spectrum(sigma: torch.Tensor) -> float:
    """AM(sigma)^2 / GM(sigma)^2: the high-resolution gain of bits by sigma over the same basis
    at uniform bits (sigma [D], a row of ``sorted_basis``'s, clamped at 1e-8 of its max): the
    score error of coordinate i goes as sigma_i^2 2^(-2 b_i)."""
    r = sigma.clamp(min=sigma.max() * 1e-8)
    return float((r.mean() / r.log().mean().exp()) ** 2)
