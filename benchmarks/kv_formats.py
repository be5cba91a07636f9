"""The cache formats of ``kv_format_study.py`` (issue 33), applied as fake quantization: rows
through a format and back (quantize, then dequantize), in the rows' dtype; ``fake_quant`` names
them. The formats calibrated per layer ("fmt:layer") read the tables below (``MU``, ``S``, ``W``,
``SV``, ``MUV``), which ``kv_format_study.calibrate_k`` fills from the calibration split. A
study, CPU only.

Formats (all but int8 / none after rotation.rotate, then rotation.unrotate):
  fp8t           : FP8 e4m3 per tensor, scale 1.0 (kvq eval's --kv fp8; not rotated)
  none, int8     : unquantized / int8 per (token, head) (quant.quantize_per_token_head, half away)
  int4           : the mode's exact math (quant.quantize_int4_rotated / dequantize_int4_rotated)
  nf4            : 16 Lloyd-Max levels of N(0, 1), symmetric, one fp32 scale per row, chosen among
                   rms * NF_SCALE_GRID by least squared error (then one least-squares refit kept
                   only where it lowers the error); scale's 4 low mantissa bits cleared
  nf4a           : nf4 levels around a per-row offset: offset = (z - 8) * scale / 8, z in 0..15
                   (4 bits, in the scale's low mantissa bits); z and scale by least squared error
  u3 / u5        : the mode's asymmetric MSE-clipped uniform math with 7 / 31 levels (3 / 5 bits)
  nf3 / nf5      : Lloyd-Max 8 / 32 levels, symmetric, as nf4
  int4c          : K centred (int4s at alpha 0): k - mu through the int4 mode's math, + mu (mu:
                   the mean k per layer, kv head and channel over the corpus's calibration split,
                   4 x 1024 tokens). A
                   constant shift of every key leaves each query's softmax unchanged (q . mu is
                   the same for every token), so a cache could hold the codes of k - mu as they are
  int4s          : K scaled and centred: (k - mu) / s through the int4 mode's math, then * s + mu,
                   s calibrated per (layer, kv head, channel) with mu: s_c = sqrt(rms(k_c) /
                   rms(q_c)) (post-RoPE q and k, q over the kv head's query group, SmoothQuant's
                   balance at alpha 0.5), scaled to a geometric mean of 1 per (layer, kv head). The
                   kernel would multiply q by s ((q * s) . (k / s) = q . k): no cache bytes. With
                   the rotation after the scaling the error is about isotropic in the scaled basis,
                   and (sum_c q_c^2 s_c^2)(sum_c k_c^2 / s_c^2) is least at s_c^2 = rms(k_c) / rms(q_c)
  int4s0         : K scaled only: k / s through the int4 mode's math, then * s (int4s's s)
  int4s0aNN      : int4s0 / int4s with s_c = (rms(k_c) / rms(q_c))^alpha, alpha = NN / 100 (two
  int4saNN         digits; int4s0 is alpha 0.5): derived from int4s's s as s^(2 alpha), which keeps
                   the geometric mean 1 per (layer, kv head); alpha 0 is the int4 mode
  int4s0p        : s tied across RoPE pairs: transformers' rotate_half RoPE (Llama, Gemma-3)
  int4sp           rotates channel c with c + D/2 by one angle, so s_c = s_{c+D/2} = sqrt(s_c *
  int4s0aNNp       s_{c+D/2}) (the geometric mean of the pair's s) commutes with RoPE: int4s0p's
                   scaling could be folded into the q / k projections (or Gemma's q / k norm
                   weights) before RoPE, with no change to the kernel. int4sp's mu would not fold
  u5s / u5s0     : K as int4s / int4s0 but with 5-bit codes (u5's math: 31 levels), a format no
                   mode has: 80 code bytes per (token, head) at D 128, so k5v4 would take 152
                   bytes with the scales, within the 3.3x capacity budget (~155)
  int4w / int4w0 : K through a calibrated full transform M per (layer, kv head) instead of int4s's
  u5w / u5w0       diagonal s (``k_transform``: the error model's optimum, M^T M the matrix
                   geometric mean of C_k^-1 and C_q), centred (int4w) or not (int4w0), then the
                   rotation and the int4 mode's math (u5w: 31 levels); a kernel would read M^-T q
  int4vs /       : V (a V format) scaled per (layer, kv head, channel) against the o_proj columns
  int4vs0          that read it (``v_channel_scales``: s_c^2 = rms(v_c) / w_c), centred or not,
                   through the int4 mode's math: foldable into W_v and W_o, no kernel
  kc16 / kc32    : K per channel over groups of 16 / 32 consecutive tokens of a call (KIVI's keys):
  kc32r            4-bit asymmetric, a scale and zero point per (group, kv head, channel), a partial
                   group over its own rows; kc32r rotated first. Only the teacher-forced KL means
                   anything for them: the greedy decode feeds one token a call (a group of one)
  tc<plan> /     : transform coding (``kv_transform_coding.py``): K in a calibrated basis (tc: full,
  tcd<plan> /      tcd: the K channel scales' diagonal with the channels sorted), bits by the
  tcw<NNN>         coordinates' weight per its plan (tcw: water-filled per kv head, NNN / 100 bits
  tcv<plan>        a coordinate); tcv: V in its basis against o_proj
"""

from __future__ import annotations

import math
import re

import kv_transform_coding as tc
import torch

from torch_kvq.attention import k_basis, quant, rotation

NF_SCALE_GRID = tuple(0.70 + 0.05 * i for i in range(13))  # 0.70 .. 1.30 times the row rms


# -- Lloyd-Max levels for N(0, 1) ---------------------------------------------------------------
def lloyd_max_gaussian(n: int, iters: int = 2000) -> torch.Tensor:
    phi = lambda t: torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda t: 0.5 * (1 + torch.erf(t / math.sqrt(2)))  # noqa: E731
    lv = torch.linspace(-2.5, 2.5, n, dtype=torch.float64)
    for _ in range(iters):
        b = torch.cat(
            [
                torch.tensor([-math.inf], dtype=torch.float64),
                (lv[1:] + lv[:-1]) / 2,
                torch.tensor([math.inf], dtype=torch.float64),
            ]
        )
        pa, pb = phi(b[:-1]), phi(b[1:])
        pa = torch.where(torch.isinf(b[:-1]), torch.zeros_like(pa), pa)
        pb = torch.where(torch.isinf(b[1:]), torch.zeros_like(pb), pb)
        lv = (pa - pb) / (cdf(b[1:]) - cdf(b[:-1]))
    return lv


LEVELS = {n: lloyd_max_gaussian(n).float() for n in (8, 16, 32)}


def _clear_low(scale: torch.Tensor, bits: int = 4) -> torch.Tensor:
    return (scale.view(torch.int32) & ~((1 << bits) - 1)).view(torch.float32)


def _nearest(y: torch.Tensor, lv: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level of each element of y (lv ascending)."""
    mids = (lv[1:] + lv[:-1]) / 2
    return torch.bucketize(y, mids)


def _nf_candidates(y, lv, s, z):
    """Candidates s, z [C, *rows]: (out [C, *rows, D], L [C, *rows, D], err [C, *rows])."""
    s = _clear_low(s.clamp(min=quant.SCALE_FLOOR))
    off = (z / 8.0) * s
    t = (y.unsqueeze(0) - off.unsqueeze(-1)) / s.unsqueeze(-1)
    L = lv[_nearest(t, lv)]
    out = L * s.unsqueeze(-1) + off.unsqueeze(-1)
    err = (out - y.unsqueeze(0)).double().square().sum(-1)
    return out, L, err


def _pick(out, L, err):
    """The first candidate of least error per row (as the mode's clipping: first on a tie)."""
    i = err.argmin(0)  # first minimum
    g = i.unsqueeze(0).unsqueeze(-1).expand(1, *out.shape[1:])
    return out.gather(0, g)[0], L.gather(0, g)[0], err.gather(0, i.unsqueeze(0))[0]


def nf_fake(y: torch.Tensor, n: int, asym: bool = False) -> torch.Tensor:
    """Rows y [..., D] fp32 (rotated) through n Lloyd-Max levels with one scale per row (and for
    asym a 4-bit offset code z: offset (z - 8) / 8 * scale) and back; the (scale, offset) of least
    squared error among rms * NF_SCALE_GRID (x the 16 offsets for asym)."""
    lv = LEVELS[n].to(y.device)
    rms = y.square().mean(-1).sqrt().clamp(min=quant.SCALE_FLOOR)
    grid = torch.tensor(NF_SCALE_GRID, dtype=torch.float32)
    zs = torch.arange(-8, 8, dtype=torch.float32) if asym else torch.zeros(1)
    cs, zz = torch.meshgrid(grid, zs, indexing="ij")
    shape = (-1,) + (1,) * rms.dim()
    s = rms.unsqueeze(0) * cs.reshape(shape)
    z = zz.reshape(shape).expand_as(s)
    out, L, err = _pick(*_nf_candidates(y, lv, s, z))
    if not asym:  # one least-squares refit of the scale for the best codes, kept where better
        s2 = (y * L).sum(-1) / L.square().sum(-1).clamp(min=1e-12)
        o2, L2, e2 = _nf_candidates(y, lv, s2.unsqueeze(0), torch.zeros_like(s2).unsqueeze(0))
        better = (e2[0] < err).unsqueeze(-1)
        out = torch.where(better, o2[0], out)
    return out


def uniform_fake(y: torch.Tensor, levels: int, half_scale: bool = False) -> torch.Tensor:
    """The mode's asymmetric MSE-clipped math (quant._int4_codes) with ``levels`` + 1 codes;
    ``half_scale``: the scale rounded to fp16 (the zero point in a byte of its own) instead of
    fp32 with the zero point in its low mantissa bits."""
    best_err = best_out = None
    bits = int(math.log2(levels + 1))
    for r in quant.INT4_CLIP_RATIOS:
        lo, hi = y.amin(-1).clamp(max=0.0) * r, y.amax(-1).clamp(min=0.0) * r
        scale = ((hi - lo) * (1.0 / levels)).clamp(min=quant.SCALE_FLOOR)
        # (fp16's smallest normal is 6.1e-5: no subnormal scale)
        scale = scale.half().float().clamp(min=6.2e-5) if half_scale else _clear_low(scale, bits)
        zp = quant.round_half_away(-lo / scale).clamp(0, levels)
        c = quant.round_half_away(y * torch.reciprocal(scale).unsqueeze(-1) + zp.unsqueeze(-1))
        out = (c.clamp(0, levels) - zp.unsqueeze(-1)) * scale.unsqueeze(-1)
        err = (out - y).double().square().sum(-1)
        if best_err is None:
            best_err, best_out = err, out
        else:
            better = err < best_err
            best_out = torch.where(better.unsqueeze(-1), out, best_out)
            best_err = torch.minimum(err, best_err)
    return best_out


def fake_quant(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [T, KH, D] through the cache format ``fmt`` and back, in x's dtype."""
    if fmt == "none":
        return x
    if fmt == "int8":
        codes, scales = quant.quantize_per_token_head(x, "int8")
        return quant.dequantize_per_token_head(codes, scales).to(x.dtype)
    if fmt == "fp8t":  # FP8 per tensor, scale 1.0 (kvq eval's "fp8"), not rotated
        return quant.dequantize_fp8(quant.quantize_fp8(x, 1.0), 1.0).to(x.dtype)
    if fmt == "int4":
        return quant.dequantize_int4_rotated(*quant.quantize_int4_rotated(x)).to(x.dtype)
    if ":" in fmt and tc.split_format(fmt.split(":")[0]):  # transform coding
        head, layer = fmt.split(":")
        return tc.alloc_fake(x, head, int(layer), uniform_fake)
    if fmt.startswith("int4c:"):  # centred only: int4s at alpha 0 (s = 1)
        return scaled_int4(x, int(fmt.split(":")[1]), centre=True, alpha=0.0)
    if fmt.split(":")[0] in ("int4vs", "int4vs0"):  # V scaled against o_proj (and centred)
        head, layer = fmt.split(":")
        return scaled_v(x, int(layer), head == "int4vs")
    if fmt.split(":")[0] in ("int4w", "int4w0", "u5w", "u5w0"):  # K through a calibrated M
        head, layer = fmt.split(":")
        return transformed_k(x, int(layer), not head.endswith("0"), 15 if "4" in head else 31)
    if fmt.split(":")[0] in ("u5s", "u5s0"):  # 5-bit K, scaled (and centred) as int4s / int4s0
        layer = int(fmt.split(":")[1])
        return scaled_int4(x, layer, centre=fmt.startswith("u5s:"), levels=31)
    if ":" in fmt and (m := K_SCALED.fullmatch(fmt.split(":")[0])):
        alpha = 0.5 if m["alpha"] is None else int(m["alpha"]) / 100
        layer = int(fmt.split(":")[1])
        return scaled_int4(x, layer, centre=not m["only"], alpha=alpha, pairs=bool(m["pairs"]))
    if fmt in ("kc16", "kc32", "kc32r"):
        return per_channel(x, 16 if fmt == "kc16" else 32, fmt == "kc32r")
    y = rotation.rotate(x)
    if fmt == "nf4":
        y = nf_fake(y, 16)
    elif fmt == "nf4a":
        y = nf_fake(y, 16, asym=True)
    elif fmt == "nf3":
        y = nf_fake(y, 8)
    elif fmt == "nf5":
        y = nf_fake(y, 32)
    elif fmt == "u3":
        y = uniform_fake(y, 7)
    elif fmt == "u5":
        y = uniform_fake(y, 31)
    elif fmt == "u4":  # check: must equal int4
        y = uniform_fake(y, 15)
    else:
        raise ValueError(fmt)
    return rotation.unrotate(y).to(x.dtype)


MU: dict[int, torch.Tensor] = {}  # int4c's mean k per layer [KH, D], from ``calibrate_k``
S: dict[int, torch.Tensor] = {}  # int4s's scale per layer [KH, D] (alpha 0.5), ``calibrate_k``
# int4w's K transform per layer and centring: (M, M^-1) [KH, D, D], ``calibrate_k`` (``k_transform``)
W: dict[tuple[int, bool], tuple[torch.Tensor, torch.Tensor]] = {}
# int4vs's V scale and mean per layer [KH, D], ``v_channel_scales``; the sums it starts from
SV: dict[int, torch.Tensor] = {}
MUV: dict[int, torch.Tensor] = {}
V_SUMS: dict[int, torch.Tensor] = {}
V_SQ: dict[int, torch.Tensor] = {}
VV: dict[int, torch.Tensor] = {}  # sum of v v^T per layer [KH, D, D] (float64), ``calibrate_k``
KK: dict[int, torch.Tensor] = {}  # sum of k k^T per layer [KH, D, D] (float64), ``calibrate_k``
QQ: dict[int, torch.Tensor] = {}  # sum of q q^T over each kv head's query group [KH, D, D]
# the scaled K formats: int4s / int4s0 (only: not centred), alpha NN / 100, p: tied across RoPE pairs
K_SCALED = re.compile(r"int4s(?P<only>0?)(?:a(?P<alpha>\d\d))?(?P<pairs>p?)")


PER_LAYER_V = ("int4vs", "int4vs0")  # V formats calibrated per layer ("fmt:layer")


def per_layer_k(fmt: str) -> bool:
    """Whether K format ``fmt`` is calibrated per layer (written "fmt:layer" per layer)."""
    named = ("int4c", "u5s", "u5s0", "int4w", "int4w0", "u5w", "u5w0")
    kind = (tc.split_format(fmt) or ("",))[0]
    return fmt in named or K_SCALED.fullmatch(fmt) is not None or kind in tc.K_KINDS


def per_layer_v(fmt: str) -> bool:
    """Whether V format ``fmt`` is calibrated per layer."""
    return fmt in PER_LAYER_V or (tc.split_format(fmt) or ("",))[0] in tc.V_KINDS


def smooth_scale(s: torch.Tensor, alpha: float = 0.5, pairs: bool = False) -> torch.Tensor:
    """The scale of alpha from int4s's s [..., D] (alpha 0.5, geometric mean 1 per row):
    (rms(k_c) / rms(q_c))^alpha up to a constant per row is s^(2 alpha), whose geometric mean is
    1 again; ``pairs``: channels c and c + D/2 (one RoPE pair under rotate_half) both take the
    pair's geometric mean sqrt(s_c * s_{c+D/2}), which keeps the row's geometric mean 1."""
    out = s.double().pow(2 * alpha)
    if pairs:
        h = out.shape[-1] // 2
        g = (out[..., :h] * out[..., h:]).sqrt()
        out = torch.cat([g, g], -1)
    return out.float()


def scaled_int4(
    x: torch.Tensor,
    layer: int,
    centre: bool,
    alpha: float = 0.5,
    pairs: bool = False,
    levels: int = 15,
) -> torch.Tensor:
    """int4s / int4s0 / int4c: (x - mu) / s through the int4 mode's math, then * s + mu (mu 0
    for int4s0); s = ``smooth_scale(S[layer], alpha, pairs)`` (S[layer] itself at alpha 0.5
    untied, exactly 1 at alpha 0)."""
    s = smooth_scale(S[layer], alpha, pairs).to(x.dtype)
    mu = MU[layer].to(x.dtype) if centre else torch.zeros_like(s)
    return (rotated_round_trip((x - mu) / s, levels) * s + mu).to(x.dtype)


def rotated_round_trip(z: torch.Tensor, levels: int = 15) -> torch.Tensor:
    """z through the rotation, the clipped uniform math with ``levels`` + 1 codes and back: at 15
    the int4 mode's exact math, else ``uniform_fake`` (u5s, u5w: 31)."""
    if levels == 15:
        return quant.dequantize_int4_rotated(*quant.quantize_int4_rotated(z))
    return rotation.unrotate(uniform_fake(rotation.rotate(z), levels))


def k_transform(ck: torch.Tensor, cq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4w's (M, M^-1) [KH, D, D] float32 from k's and q's second moments [KH, D, D] (float64):
    the library's ``k_basis.balanced_transform`` (the cache holds M k, the kernel would read
    M^-T q, (M^-T q) . (M k) = q . k; its docstring has the error model)."""
    m = k_basis.balanced_transform(ck, cq)
    return m.float(), torch.linalg.inv(m).float()


def v_channel_scales(lm, layers, counts) -> None:
    """``SV`` / ``MUV``: V's balance against the o_proj columns that read it. V's error, about
    isotropic after the rotation in the scaled basis, reaches the next layer as W_o diag(s) e, so
    its size goes as (sum_c w_c^2 s_c^2)(sum_c v_c^2 / s_c^2), least at s_c^2 = rms(v_c) / w_c,
    w_c^2 the squared norms of the o_proj columns of channel c summed over the kv head's query
    heads. A model could fold both into its weights (v / s into W_v's rows, s into W_o's columns,
    the mean into o_proj's bias): no kernel. Geometric mean 1 per kv head."""
    for i, layer in enumerate(layers):
        path = lm.layer_paths[layer.layer_name]
        w = lm.hf.get_submodule(path).o_proj.weight.detach().double()  # [hidden, H * D]
        kh, d = V_SQ[i].shape
        h = w.shape[1] // d
        col = w.square().sum(0).reshape(kh, h // kh, d).sum(1).sqrt()  # [KH, D]
        rms_v = (V_SQ[i] / counts[i]).sqrt()
        live = (rms_v > 0) & (col > 0)
        sv = torch.where(live, (rms_v / torch.where(live, col, 1.0)).sqrt(), 1.0)
        SV[i] = (sv / sv.log().mean(-1, keepdim=True).exp()).float()
        MUV[i] = (V_SUMS[i] / counts[i]).float()


def transform_bases(lm, layers, counts) -> None:
    """``tc.BASES`` per layer: "tc" K's sorted balanced basis (from int4w0's M), "tcd" the
    diagonal one (int4s0's s), "tcv" V's against the o_proj metric; prints the spectra's
    high-resolution gains (``tc.spectrum``), mean over layers and kv heads."""
    gains: dict[str, list[float]] = {"tc": [], "tcv": []}
    for i, layer in enumerate(layers):
        ck = KK[i] / counts[i]
        t, t_inv, sig = tc.sorted_basis(*W[(i, False)], ck)
        tc.BASES[("tc", i)] = (t, t_inv)
        for mean in (350, 375, 400):
            tc.WATER[(i, mean)] = [tc.water_fill(r, mean / 100) for r in sig]
        tc.BASES[("tcd", i)] = tc.diag_basis(S[i], ck)
        w = lm.hf.get_submodule(lm.layer_paths[layer.layer_name]).o_proj.weight.detach()
        cv = VV[i] / counts[i]
        g = tc.o_proj_metric(w, *cv.shape[:2])
        tv, tv_inv, sig_v = tc.sorted_basis(*k_transform(cv, g), cv)
        tc.BASES[("tcv", i)] = (tv, tv_inv)
        gains["tc"] += [tc.spectrum(r) for r in sig]
        gains["tcv"] += [tc.spectrum(r) for r in sig_v]
    plans = [p for v in tc.WATER.values() for p in v]
    print(
        f"tcw: groups per kv head {sum(map(len, plans)) / len(plans):.2f} (mean), up to "
        f"{max(map(len, plans))}; e.g. layer 0 at 3.75 {tc.WATER[(0, 375)][0]}",
        flush=True,
    )
    print(
        "transform coding, high-resolution gain of bits by sigma (mean over layers and kv heads): "
        + ", ".join(f"{k} {sum(v) / len(v):.2f}" for k, v in gains.items()),
        flush=True,
    )


def scaled_v(x: torch.Tensor, layer: int, centre: bool) -> torch.Tensor:
    """int4vs / int4vs0: (v - mean) / s through the int4 mode's math, then * s + mean."""
    s = SV[layer].to(x.dtype)
    mu = MUV[layer].to(x.dtype) if centre else torch.zeros_like(s)
    return (rotated_round_trip((x - mu) / s) * s + mu).to(x.dtype)


def transformed_k(x: torch.Tensor, layer: int, centre: bool, levels: int) -> torch.Tensor:
    """int4w / int4w0 / u5w / u5w0: M (k - mu) through the rotation and the uniform math (the
    int4 mode's at 15 levels), then M^-1 and + mu (mu 0 when not centred)."""
    m, m_inv = W[(layer, centre)]
    mu = MU[layer].to(x.dtype) if centre else torch.zeros_like(MU[layer])
    y = rotated_round_trip(torch.einsum("hde,the->thd", m, x.float() - mu), levels)
    return (torch.einsum("hde,the->thd", m_inv, y) + mu).to(x.dtype)


def per_channel(x: torch.Tensor, group: int, rot: bool) -> torch.Tensor:
    """kc16 / kc32 / kc32r: x [T, KH, D] per channel over groups of ``group`` consecutive rows."""
    y = rotation.rotate(x) if rot else x.float()
    out = torch.empty_like(y)
    for s in range(0, y.shape[0], group):
        c = y[s : s + group]
        lo, hi = c.amin(0).clamp(max=0.0), c.amax(0).clamp(min=0.0)
        scale = ((hi - lo) / 15).clamp(min=quant.SCALE_FLOOR)
        zp = quant.round_half_away(-lo / scale).clamp(0, 15)
        out[s : s + group] = (quant.round_half_away(c / scale + zp).clamp(0, 15) - zp) * scale
    return (rotation.unrotate(out) if rot else out).to(x.dtype)
