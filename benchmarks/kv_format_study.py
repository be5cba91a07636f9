"""Which 4-bit V (and K) format at the int4 mode's bytes (D/2 code bytes + one fp32 scale per
(token, kv head)) buys greedy agreement on SmolLM2-135M (issue 33; docs/accuracy.md, "Which part
of the 4-bit cache costs agreement"); --model picks another trained model (e.g. gemma3-270m, with
the "full:" prefix below). A study, CPU only: it builds no mode.

Like benchmarks/int4_study.py (c418a04): every layer's k and v go through a cache format and back
(fake quantization in a pre-hook on each ``Attention`` layer, into the model-dtype fp32 cache), so
prefill and decode read what the cache would hold; k and v have separate formats per layer.

Measures per config:
  (a) greedy agreement on kvq eval's 30-prompt settings (``measure`` with prompts=30,
      prompt_tokens=32, new_tokens=32, window=2, windows=1, decode_tokens=0), as ``eval.row``
      (``--prompt-offsets N``: N prompts per eval text, at tokens 0, 256, ...);
  (b) mean KL(ref || cand) of the next-token distributions at the 32 generated positions of
      each prompt, teacher-forced on the reference's greedy tokens (one prefill of prompt +
      reference tokens), plus the teacher-forced top-1 match there;
  (c) optionally (--ppl) teacher-forced perplexity on kvq eval's default windows (4 x 1024,
      prefill only; the decode phase is not run).
Also (--mse) MSE per element of each format on real k / v rows (one 1024-token window, all layers).

Formats (all but int8 / none after quant.rotate, then quant.unrotate):
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
Config syntax: "K/V" on every layer (e.g. "int4/nf4"), with optional prefixes (see
``layer_formats``): "full:K/V", K / V only on the full-attention layers (whose ``Attention`` spec
has no ``sliding_window``), the sliding-window layers "none" (the model dtype) as the
int4-recommended preset keeps them (e.g. Gemma-3's "full:int4s0/int4": layers 5, 11, 17; a model
without sliding layers: the same as "K/V"); "rec:K/V", the preset's map: K as int8 on the preset's
measured layers for the model (SmolLM2 1, 3, 4, 6, 12, 13, 16, 22; Gemma-3 5, 11, 17) and as K on
the other full-attention layers, V on every full-attention layer, sliding layers "none" (e.g.
"rec:int4s/int4"; Gemma-3's "rec:int4/int4" is "full:int8/int4"); "rec5:K/V" the same map with
5-bit scaled K (u5s0) where "rec:" has int8. A leading "sinkN:" keeps each sequence's first N
positions (the attention sinks) in the model dtype, "midN:" positions 16 .. 16 + N - 1 (the
control), e.g. "sink4:int4/int4"; "ksinkN:" / "vsinkN:" k or v alone.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kv_transform_coding as tc  # noqa: E402

from torch_kvq.attention import quant  # noqa: E402

REC_LAYERS = (1, 3, 4, 6, 12, 13, 16, 22)
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
    y = quant.rotate(x)
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
    return quant.unrotate(y).to(x.dtype)


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
    return quant.unrotate(uniform_fake(quant.rotate(z), levels))


def _sqrtm(a: torch.Tensor) -> torch.Tensor:
    w, v = torch.linalg.eigh(a)
    return (v * w.clamp(min=0).sqrt().unsqueeze(-2)) @ v.transpose(-1, -2)


def k_transform(ck: torch.Tensor, cq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4w's (M, M^-1) [KH, D, D] from k's and q's second moments [KH, D, D] (float64): the
    cache holds M k, the kernel would read M^-T q, (M^-T q) . (M k) = q . k. The error model of
    int4s (isotropic error after the rotation, of variance ~ the row's energy) makes the score
    error ~ tr(M C_k M^T) tr(M^-T C_q M^-1), least at M^T M = P, P C_k P = C_q (the matrix
    geometric mean of C_k^-1 and C_q): M = P^1/2. Both moments get 1e-6 of their mean diagonal
    on the diagonal (Gemma-3's channels that are 0 on the calibration split)."""
    eye = torch.eye(ck.shape[-1], dtype=ck.dtype)
    reg = lambda c: c + 1e-6 * c.diagonal(0, -2, -1).mean(-1)[:, None, None] * eye  # noqa: E731
    ck, cq = reg(ck), reg(cq)
    r = _sqrtm(ck)
    r_inv = torch.linalg.inv(r)
    p = r_inv @ _sqrtm(r @ cq @ r) @ r_inv
    m = _sqrtm(p)
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
    print(f"tcw: groups per kv head {sum(map(len, plans)) / len(plans):.2f} (mean), up to "
          f"{max(map(len, plans))}; e.g. layer 0 at 3.75 {tc.WATER[(0, 375)][0]}", flush=True)
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
    y = quant.rotate(x) if rot else x.float()
    out = torch.empty_like(y)
    for s in range(0, y.shape[0], group):
        c = y[s : s + group]
        lo, hi = c.amin(0).clamp(max=0.0), c.amax(0).clamp(min=0.0)
        scale = ((hi - lo) / 15).clamp(min=quant.SCALE_FLOOR)
        zp = quant.round_half_away(-lo / scale).clamp(0, 15)
        out[s : s + group] = (quant.round_half_away(c / scale + zp).clamp(0, 15) - zp) * scale
    return (quant.unrotate(out) if rot else out).to(x.dtype)


EXACT = re.compile(r"(?P<side>[kv]?)(?P<where>sink|mid)(?P<n>\d+):")


def exact_positions(config: str) -> tuple[tuple[int, int, str] | None, str]:
    """A leading "sinkN:" (positions 0 .. N-1 of every sequence, the attention sinks, kept in the
    model dtype: a cache would hold them apart, N tokens a sequence) or "midN:" (positions 16 ..
    16 + N - 1, the control: as many exact tokens where no sink is), "k" or "v" before it for k
    or v alone ("ksink1:") -> ((first, end, "kv" | "k" | "v"), the rest of the config); (None,
    config) without one."""
    if (m := EXACT.match(config)) is None:
        return None, config
    first = 0 if m["where"] == "sink" else 16
    return (first, first + int(m["n"]), m["side"] or "kv"), config[m.end() :]


def cache_pre_hook(fmts: tuple[str, str], exact: tuple[int, int, str] | None = None):
    """A forward pre-hook for an ``Attention`` layer: its k and v through the formats ``fmts``
    (K, V) and back, but the rows at positions in [exact[0], exact[1]) of the sides exact[2]
    ("kv", "k" or "v") as they came."""
    from torch_kvq.attention.context import get_forward_context

    def hook(mod, a, kw):
        k, v = fake_quant(a[1], fmts[0]), fake_quant(a[2], fmts[1])
        if exact is not None:
            pos = get_forward_context().metadata_for(mod.spec).positions
            keep = ((pos >= exact[0]) & (pos < exact[1]))[:, None, None]
            k = torch.where(keep, a[1], k) if "k" in exact[2] else k
            v = torch.where(keep, a[2], v) if "v" in exact[2] else v
        return (a[0], k, v, *a[3:]), kw

    return hook


def parse_config(config: str) -> tuple[set[str], str, str]:
    """("full:" / "rec:" / "rec5:" / "rectc:" prefixes, K, V) of a config such as
    "full:int4s0/int4"."""
    prefixes = set()
    while (head := config.split(":", 1)[0]) in ("full", "rec", "rec5", "rectc") and ":" in config:
        prefixes.add(head)
        config = config.split(":", 1)[1]
    k, v = config.split("/")
    return prefixes, k, v


def layer_formats(
    config: str,
    n: int,
    sliding: frozenset[int] | set[int] = frozenset(),
    rec_layers: tuple[int, ...] = REC_LAYERS,
) -> list[tuple[str, str]]:
    """(K format, V format) for each of ``n`` layers; ``sliding``: the indices of the layers with a
    sliding window. "K/V": every layer; "full:K/V": the layers not in ``sliding``, which stay
    ("none", "none"); "rec:K/V": the int4-recommended preset's map, K as int8 on ``rec_layers``
    (the preset's measured layers for the model) and as K on the other full-attention layers, V on
    every full-attention layer, the sliding ones "none" (as the preset's "sliding_window: auto");
    "rec5:K/V": the same with K as u5s0 (5-bit, scaled) instead of int8 on ``rec_layers``;
    "rectc:K/V": K / V on every full-attention layer but ``rec_layers``, which take the
    transform-coded candidate tc643 / tcv5554 (K and V)."""
    prefixes, k, v = parse_config(config)
    sens = "int8" if "rec" in prefixes else ("u5s0" if "rec5" in prefixes else None)
    skip = sliding if prefixes else frozenset()
    if "rectc" in prefixes:
        cand = lambda i: (f"tc643:{i}", f"tcv5554:{i}")  # noqa: E731
        other = layer_formats(f"{k}/{v}", n)
        return [("none", "none") if i in skip else cand(i) if i in rec_layers else other[i]
                for i in range(n)]  # fmt: skip

    def k_of(i: int) -> str:
        f = sens if sens is not None and i in rec_layers else k
        return f"{f}:{i}" if per_layer_k(f) else f

    v_of = lambda i: f"{v}:{i}" if per_layer_v(v) else v  # noqa: E731
    return [("none", "none") if i in skip else (k_of(i), v_of(i)) for i in range(n)]


def calibrate_k(lm, tok, layers) -> dict:
    """``MU``: the mean k per layer, kv head and channel over the calibration split's windows;
    ``S``: int4s's s_c = sqrt(rms(k_c) / rms(q_c)) per layer, kv head and channel over the same
    windows (q over the kv head's query group), geometric mean 1 per (layer, kv head); a channel
    whose q and k are both 0 (Gemma-3's layers 5 and 17 have a few) gets a tiny s from the clamps,
    harmless (k_c / s = 0) but it dominates the printed max / min. The
    pre-hook's args are the ``Attention`` layer's (q [T, H, D], k [T, KH, D], v), post-RoPE (the
    transformers attention module applies RoPE before its attention interface call). Returns the
    max / min of s per layer and kv head."""
    from torch_kvq.evaluation import corpus
    from torch_kvq.evaluation.eval import EvalSettings, eval_data, teacher_forced_ppl

    sums: dict[int, torch.Tensor] = {}
    k_sq: dict[int, torch.Tensor] = {}
    q_sq: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    groups: dict[int, int] = {}

    def catch(i, args):
        q = args[0].detach().double()  # [T, H, D]
        k = args[1].detach().double()  # [T, KH, D]
        t, kh, d = k.shape
        sums[i] = sums.get(i, 0) + k.sum(0)
        v = args[2].detach().double()  # [T, KH, D]
        V_SUMS[i] = V_SUMS.get(i, 0) + v.sum(0)
        V_SQ[i] = V_SQ.get(i, 0) + v.square().sum(0)
        VV[i] = VV.get(i, 0) + torch.einsum("thd,the->hde", v, v)
        k_sq[i] = k_sq.get(i, 0) + k.square().sum(0)
        # query head h reads kv head h // (H / KH): [T, KH, G, D], summed over tokens and group
        q_sq[i] = q_sq.get(i, 0) + q.reshape(t, kh, -1, d).square().sum((0, 2))
        KK[i] = KK.get(i, 0) + torch.einsum("thd,the->hde", k, k)
        QQ[i] = QQ.get(i, 0) + torch.einsum("thgd,thge->hde", *[q.reshape(t, kh, -1, d)] * 2)
        counts[i] = counts.get(i, 0) + t
        groups[i] = q.shape[1] // kh

    hs = [m.register_forward_pre_hook(lambda mod, a, kw, i=i: catch(i, a), with_kwargs=True)
          for i, m in enumerate(layers)]  # fmt: skip
    try:
        cal = eval_data(
            tok, EvalSettings(decode_tokens=0, new_tokens=0), corpus.split("calibration")
        )
        teacher_forced_ppl(lm, cal.windows)
    finally:
        for h in hs:
            h.remove()
    MU.update({i: (sums[i] / counts[i]).float() for i in sums})
    v_channel_scales(lm, layers, counts)
    for i in sums:
        for centre in (False, True):
            ck = KK[i] / counts[i]
            if centre:
                mu = sums[i] / counts[i]
                ck = ck - torch.einsum("hd,he->hde", mu, mu)
            W[(i, centre)] = k_transform(ck, QQ[i] / (counts[i] * groups[i]))
    print(
        f"int4c: mu over {counts[0]} calibration tokens; mean |mu| per layer "
        f"{[round(float(MU[i].norm(dim=-1).mean()), 2) for i in sorted(MU)]}",
        flush=True,
    )
    spread = {}
    for i in sorted(k_sq):
        rms_k = (k_sq[i] / counts[i]).sqrt()
        rms_q = (q_sq[i] / (counts[i] * groups[i])).sqrt()
        s = (rms_k / rms_q.clamp(min=1e-12)).clamp(min=1e-12).sqrt()  # [KH, D]
        s = s / s.log().mean(-1, keepdim=True).exp()  # geometric mean 1 per kv head
        S[i] = s.float()
        spread[i] = (s.amax(-1) / s.amin(-1)).tolist()  # per kv head
    transform_bases(lm, layers, counts)
    print(
        f"int4s: s over {counts[0]} calibration tokens (query group {groups[0]}); max / min of s per "
        f"layer (the largest over kv heads) {[round(max(spread[i]), 1) for i in sorted(spread)]}; "
        f"over all layers and heads {min(min(v) for v in spread.values()):.1f} .. "
        f"{max(max(v) for v in spread.values()):.1f}",
        flush=True,
    )
    return spread


def offset_prompts(tok, texts, data, n: int, stride: int = 256):
    """``data`` with its prompts replaced by ``n`` per eval text, 32 tokens at token offsets 0,
    ``stride``, 2 ``stride``, ... (where the text is long enough): more prompts, less of the
    agreement metric's noise (one near-tie moves a 30-prompt row by up to ~10 points)."""
    from dataclasses import replace

    prompts, files = [], []
    for fid, text in texts:
        ids = tok(text)["input_ids"]
        for j in range(n):
            if len(ids) >= j * stride + 32:
                prompts.append(tuple(ids[j * stride : j * stride + 32]))
                files.append(f"{fid}@{j * stride}")
    return replace(data, prompts=tuple(prompts), prompt_files=tuple(files))


def main() -> None:
    from torch_kvq.evaluation import corpus
    from torch_kvq.evaluation.eval import (
        EvalSettings,
        _Runner,
        eval_data,
        measure,
        teacher_forced_ppl,
    )
    from torch_kvq.integrations.trained import load_trained
    from torch_kvq.kv_presets import PRESETS
    from torch_kvq.spec import KVCacheConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--configs", nargs="+", default=["int4/int4", "int8/int8", "int8/int4"])
    ap.add_argument("--ppl", action="store_true", help="also teacher-forced ppl on 4 x 1024")
    ap.add_argument("--mse", action="store_true", help="MSE per element on real k / v rows")
    ap.add_argument(
        "--mse-formats",
        nargs="+",
        default=["int4", "u4", "nf4", "nf4a", "u3", "nf3", "u5", "nf5", "int8"],
    )
    ap.add_argument("--prompt-offsets", type=int, default=1,
                    help="prompts per eval text, at tokens 0, 256, 512, ... (default 1: kvq eval's)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("torch_kvq from", quant.__file__, flush=True)
    print("nf4 levels", [round(float(a), 4) for a in LEVELS[16]], flush=True)

    agree = EvalSettings(
        window=2, windows=1, decode_tokens=0, prompts=30 * args.prompt_offsets, prompt_tokens=32,
        new_tokens=32,
    )  # fmt: skip
    dflt = EvalSettings(decode_tokens=0, new_tokens=0)  # 4 x 1024 windows, prefill ppl only
    pages = max(agree.pages_needed(16), dflt.pages_needed(16))
    lm, tok = load_trained(args.model, KVCacheConfig(), num_pages=pages)
    texts = corpus.split("eval")
    data = eval_data(tok, agree, texts)
    if args.prompt_offsets > 1:
        data = offset_prompts(tok, texts, data, args.prompt_offsets)
    pdata = eval_data(tok, dflt, texts) if (args.ppl or args.mse) else None
    layers = lm.attention_layers
    sliding = frozenset(i for i, m in enumerate(layers) if m.spec.sliding_window is not None)
    rec_layers = PRESETS["int4-recommended"].measured.get(args.model)
    bare = [parse_config(exact_positions(c)[1]) for c in args.configs]
    if rec_layers is None and any("rec" in b[0] for b in bare):
        raise SystemExit(f"rec: the int4-recommended preset has no layers for {args.model!r}")
    print(f"{len(layers)} layers; sliding-window layers {sorted(sliding)}", flush=True)
    spread = None
    if any(per_layer_k(k) or per_layer_v(v) or "rectc" in pre for pre, k, v in bare):
        spread = calibrate_k(lm, tok, layers)
    out = dict(
        model=args.model,
        settings=vars(agree),
        prompt_files=data.prompt_files,
        sliding_layers=sorted(sliding),
        rows=[],
        mse=None,
    )
    if spread is not None:
        out["int4s_s_max_over_min"] = {str(i): v for i, v in spread.items()}  # [layer][kv head]

    # -- MSE on real rows -----------------------------------------------------------------------
    if args.mse:
        caught = {}

        def catch(mod, a, kw, i):
            caught[i] = (a[1].detach().clone(), a[2].detach().clone())

        hs = [
            m.register_forward_pre_hook(
                lambda mod, a, kw, i=i: catch(mod, a, kw, i), with_kwargs=True
            )
            for i, m in enumerate(layers)
        ]
        try:
            teacher_forced_ppl(lm, pdata.windows[:1])
        finally:
            for h in hs:
                h.remove()
        mse = {}
        for fmt in args.mse_formats:
            t0 = time.perf_counter()
            tot = {"k": 0.0, "v": 0.0}
            per_layer = {"k": [], "v": []}
            for i in range(len(layers)):
                for name, x in zip("kv", caught[i]):
                    e = (fake_quant(x, fmt).double() - x.double()).square().mean().item()
                    per_layer[name].append(e)
                    tot[name] += e
            mse[fmt] = dict(
                k_mean=tot["k"] / len(layers),
                v_mean=tot["v"] / len(layers),
                k_per_layer=per_layer["k"],
                v_per_layer=per_layer["v"],
            )
            print(
                f"mse {fmt:5s} k {mse[fmt]['k_mean']:.4e} v {mse[fmt]['v_mean']:.4e} "
                f"({time.perf_counter() - t0:.1f}s)",
                flush=True,
            )
        base = mse.get("int4")
        if base:
            for fmt, m in mse.items():
                rk = sum(a / b for a, b in zip(m["k_per_layer"], base["k_per_layer"])) / len(layers)
                rv = sum(a / b for a, b in zip(m["v_per_layer"], base["v_per_layer"])) / len(layers)
                m["k_rel_int4"], m["v_rel_int4"] = rk, rv
                print(
                    f"mse {fmt:5s} relative to int4 (mean over layers of the ratio): k {rk:.3f} v {rv:.3f}",
                    flush=True,
                )
        out["mse"] = mse
        del caught

    # -- reference ------------------------------------------------------------------------------
    run = _Runner(lm, lm)

    @torch.no_grad()
    def tf_logprobs(tokens):
        """log-softmax at the generated positions, teacher-forced on ``tokens`` [prompt][32]."""
        res = []
        for p, g in zip(data.prompts, tokens):
            ids = list(p) + list(g[:-1])
            seq = object()
            try:
                logits = run.step([(seq, ids)])
            finally:
                if seq in lm.allocator.sequences:
                    lm.allocator.free(seq)
            res.append(torch.log_softmax(logits[len(p) - 1 :].float(), -1))
        return res

    t0 = time.perf_counter()
    ref = measure(lm, data, agree)
    ref_lp = tf_logprobs(ref.tokens)
    ref_ppl = teacher_forced_ppl(lm, pdata.windows) if args.ppl else None
    tf_match_ref = sum(
        int((lp.argmax(-1) == torch.tensor(g)).sum()) for lp, g in zip(ref_lp, ref.tokens)
    )
    print(
        f"reference: {time.perf_counter() - t0:.1f}s ppl {ref_ppl} tf-top1 of the ref itself "
        f"{tf_match_ref}/{len(data.prompts) * 32}",
        flush=True,
    )
    out["reference"] = dict(ppl=ref_ppl, tokens=ref.tokens)

    for config in args.configs:
        exact, rest = exact_positions(config)
        fmts = layer_formats(rest, len(layers), sliding, rec_layers or REC_LAYERS)

        hs = [
            m.register_forward_pre_hook(cache_pre_hook(f, exact), with_kwargs=True)
            for m, f in zip(layers, fmts)
        ]
        t0 = time.perf_counter()
        try:
            got = measure(lm, data, agree)
            t_agree = time.perf_counter() - t0
            lp = tf_logprobs(ref.tokens)
            slow = any("nf4a" in f for f in fmts)  # ~1.4 s per 1024-row call: no ppl
            ppl = teacher_forced_ppl(lm, pdata.windows) if args.ppl and not slow else None
        finally:
            for h in hs:
                h.remove()
        pairs = [(a, b) for ta, tb in zip(got.tokens, ref.tokens) for a, b in zip(ta, tb)]
        prefix = [
            next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), len(ta))
            for ta, tb in zip(got.tokens, ref.tokens)
        ]
        kl = torch.cat([(r.exp() * (r - c)).sum(-1) for r, c in zip(ref_lp, lp)])
        tf1 = sum(int((c.argmax(-1) == torch.tensor(g)).sum()) for c, g in zip(lp, ref.tokens)) / (
            len(data.prompts) * 32
        )
        # first position where the teacher-forced argmax differs from the reference's token: what
        # the greedy prefix would be if prefill (63 tokens at once) and decode read alike
        tf_prefix = []
        for c, g in zip(lp, ref.tokens):
            m = (c.argmax(-1) != torch.tensor(g)).nonzero()
            tf_prefix.append(int(m[0, 0]) if len(m) else len(g))
        r = dict(
            config=config,
            formats=fmts,
            tf_prefix=tf_prefix,
            tf_mean_prefix=sum(tf_prefix) / len(tf_prefix),
            agreement=sum(a == b for a, b in pairs) / len(pairs),
            mean_prefix=sum(prefix) / len(prefix),
            prefix=prefix,
            full=sum(p == 32 for p in prefix),
            kl_mean=float(kl.mean()),
            kl_median=float(kl.median()),
            tf_top1=tf1,
            ppl=ppl,
            ppl_delta_pct=(100 * (ppl / ref_ppl - 1) if ppl else None),
            seconds_agreement=t_agree,
            seconds=time.perf_counter() - t0,
        )
        out["rows"].append(r)
        pp = f" ppl {ppl:.4f} ({r['ppl_delta_pct']:+.2f}%)" if ppl else ""
        print(
            f"{config:16s} agreement {100 * r['agreement']:.1f}% prefix {r['mean_prefix']:.2f} "
            f"full {r['full']} KL {r['kl_mean']:.5f} (median {r['kl_median']:.5f}) tf-top1 "
            f"{100 * tf1:.1f}% tf-prefix {r['tf_mean_prefix']:.2f}{pp} [{r['seconds']:.0f}s]",
            flush=True,
        )
        if args.json:
            args.json.write_text(json.dumps(out, indent=1) + "\n")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
