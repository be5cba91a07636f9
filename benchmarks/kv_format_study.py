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

The formats (a config's K and V names) are in ``kv_formats.py``.
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
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kv_formats as kf  # noqa: E402

from torch_kvq.attention import quant  # noqa: E402

REC_LAYERS = (1, 3, 4, 6, 12, 13, 16, 22)


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
        k, v = kf.fake_quant(a[1], fmts[0]), kf.fake_quant(a[2], fmts[1])
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
        return f"{f}:{i}" if kf.per_layer_k(f) else f

    v_of = lambda i: f"{v}:{i}" if kf.per_layer_v(v) else v  # noqa: E731
    return [("none", "none") if i in skip else (k_of(i), v_of(i)) for i in range(n)]


def calibrate_k(lm, tok, layers) -> dict:
    """``kf.MU``: the mean k per layer, kv head and channel over the calibration split's windows;
    ``kf.S``: int4s's s_c = sqrt(rms(k_c) / rms(q_c)) per layer, kv head and channel over the same
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
        kf.V_SUMS[i] = kf.V_SUMS.get(i, 0) + v.sum(0)
        kf.V_SQ[i] = kf.V_SQ.get(i, 0) + v.square().sum(0)
        kf.VV[i] = kf.VV.get(i, 0) + torch.einsum("thd,the->hde", v, v)
        k_sq[i] = k_sq.get(i, 0) + k.square().sum(0)
        # query head h reads kv head h // (H / KH): [T, KH, G, D], summed over tokens and group
        q_sq[i] = q_sq.get(i, 0) + q.reshape(t, kh, -1, d).square().sum((0, 2))
        kf.KK[i] = kf.KK.get(i, 0) + torch.einsum("thd,the->hde", k, k)
        kf.QQ[i] = kf.QQ.get(i, 0) + torch.einsum("thgd,thge->hde", *[q.reshape(t, kh, -1, d)] * 2)
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
    kf.MU.update({i: (sums[i] / counts[i]).float() for i in sums})
    kf.v_channel_scales(lm, layers, counts)
    for i in sums:
        for centre in (False, True):
            ck = kf.KK[i] / counts[i]
            if centre:
                mu = sums[i] / counts[i]
                ck = ck - torch.einsum("hd,he->hde", mu, mu)
            kf.W[(i, centre)] = kf.k_transform(ck, kf.QQ[i] / (counts[i] * groups[i]))
    print(
        f"int4c: mu over {counts[0]} calibration tokens; mean |mu| per layer "
        f"{[round(float(kf.MU[i].norm(dim=-1).mean()), 2) for i in sorted(kf.MU)]}",
        flush=True,
    )
    spread = {}
    for i in sorted(k_sq):
        rms_k = (k_sq[i] / counts[i]).sqrt()
        rms_q = (q_sq[i] / (counts[i] * groups[i])).sqrt()
        s = (rms_k / rms_q.clamp(min=1e-12)).clamp(min=1e-12).sqrt()  # [KH, D]
        s = s / s.log().mean(-1, keepdim=True).exp()  # geometric mean 1 per kv head
        kf.S[i] = s.float()
        spread[i] = (s.amax(-1) / s.amin(-1)).tolist()  # per kv head
    kf.transform_bases(lm, layers, counts)
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
    print("nf4 levels", [round(float(a), 4) for a in kf.LEVELS[16]], flush=True)

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
    if any(kf.per_layer_k(k) or kf.per_layer_v(v) or "rectc" in pre for pre, k, v in bare):
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
                    e = (kf.fake_quant(x, fmt).double() - x.double()).square().mean().item()
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
