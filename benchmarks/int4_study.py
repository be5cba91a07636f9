"""Which 4-bit per-(token, head) KV format to build (issue 33), measured on the shipped trained
models before the mode exists: every layer's k and v are quantized and dequantized on their way
into a model-dtype cache (a pre-hook on each ``Attention`` layer), so prefill and decode read
exactly what an int4 cache would hold, through ``kvq eval``'s measurement (its windows, decode
phase and greedy prompts, reference kernel, eager, fp32 on CPU).

Variants (``--variants``), ``[k:|v:]FORMAT[@KEEP]``. FORMAT: ``int8`` (int8 per (token, head), the
8-bit reference) or ``int4`` (asymmetric with a zero point, ``attention/quant.py``'s
``quantize_int4_per_token_head``) with options joined by ``-``: ``sym`` (symmetric), ``rot`` (k and
v rotated by the Hadamard of ``rotation.rotate`` before quantizing, rotated back after: q . k and the
output are unchanged by the rotation in exact arithmetic, so this equals attention in the rotated
space), ``mse`` (per-row MSE clipping over ``CLIP_RATIOS``), ``g32`` / ``g64`` (one scale and zero
point per 32 / 64 channels, ``quantize_int4_grouped``), ``sink`` (a diagnostic: token position 0
of every sequence kept unquantized). ``k:`` / ``v:`` quantize only k / only v (the other stays in
the model dtype). KEEP, ``-``-joined: ``ends8`` (layers 0 and -1 int8), ``sliding16`` (sliding-window
layers unquantized), ``only<i>`` (only layer i in FORMAT, the others unquantized), ``8x<i>.<j>``
(layers i, j int8), ``k8x<i>.<j>`` (their k int8, v as FORMAT). ``--quick`` measures the teacher-forced ppl only (no decode phase, no greedy
prompts), ``--windows`` fewer windows: the per-layer sweeps.

    python benchmarks/int4_study.py --model smollm2-135m --json int4_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch_kvq.attention import quant, rotation  # noqa: E402

VARIANTS = ("int8", "int4", "int4-rot", "int4-sym", "int4-sym-rot", "int4-rot@ends8",
            "int4-rot@sliding16", "int4-rot@ends8-sliding16")  # fmt: skip
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))  # 1.0 .. 0.5


def fake_quant(x: torch.Tensor, fmt: str, pos: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, KH, D] through the cache format ``fmt`` and back, in x's dtype (``pos`` [T]: the
    tokens' positions, for ``sink``)."""
    if fmt == "none":
        return x
    base, *opts = fmt.split("-")
    if base == "int8":
        codes, scales = quant.quantize_per_token_head(x, "int8")
        y = quant.dequantize_per_token_head(codes, scales).to(x.dtype)
    else:
        rot = "rot" in opts
        y = rotation.rotate(x) if rot else x.float()
        clip = CLIP_RATIOS if "mse" in opts else (1.0,)
        group = next((int(o[1:]) for o in opts if o[0] == "g"), x.shape[-1])
        packed, stored = quant.quantize_int4_grouped(y, group, "sym" in opts, clip)
        y = quant.dequantize_int4_grouped(packed, stored)
        y = (rotation.unrotate(y) if rot else y).to(x.dtype)
    if "sink" in opts:
        y = torch.where((pos == 0)[:, None, None], x, y)
    return y


def layer_formats(variant: str, kinds: list[str]) -> list[tuple[str, str]]:
    """The (k, v) formats of each layer (``kinds``: "sliding_attention" / "full_attention")."""
    scope, _, rest = variant.rpartition(":")
    base, _, keep = rest.partition("@")
    n = len(kinds)
    ks, vs = [base if scope != "v" else "none"] * n, [base if scope != "k" else "none"] * n
    int8_last = sorted(filter(None, keep.split("-")), key=lambda o: o == "ends8" or "8x" in o)
    for opt in int8_last:
        if opt == "sliding16":
            ks = ["none" if k == "sliding_attention" else f for f, k in zip(ks, kinds)]
            vs = ["none" if k == "sliding_attention" else f for f, k in zip(vs, kinds)]
        elif opt == "ends8":
            ks[0] = ks[-1] = vs[0] = vs[-1] = "int8"
        elif opt.startswith("only"):
            ks = [f if i == int(opt[4:]) else "none" for i, f in enumerate(ks)]
            vs = [f if i == int(opt[4:]) else "none" for i, f in enumerate(vs)]
        elif opt.startswith(("8x", "k8x")):
            for i in map(int, opt.partition("8x")[2].split(".")):
                ks[i] = "int8"
                if opt[0] == "8":
                    vs[i] = "int8"
        else:
            raise ValueError(f"unknown keep option {opt!r} in {variant!r}")
    return list(zip(ks, vs))


def main() -> None:
    from torch_kvq.attention.context import get_forward_context
    from torch_kvq.attention.layer import Attention
    from torch_kvq.evaluation import corpus
    from torch_kvq.evaluation.eval import EvalSettings, eval_data, measure
    from torch_kvq.integrations.trained import load_trained
    from torch_kvq.spec import KVCacheConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="teacher-forced ppl only")
    ap.add_argument("--windows", type=int, default=EvalSettings.windows)
    args = ap.parse_args()
    torch.set_num_threads(1)
    quick = dict(decode_tokens=0, new_tokens=0) if args.quick else {}
    settings = EvalSettings(windows=args.windows, **quick)
    lm, tok = load_trained(args.model, KVCacheConfig(), num_pages=settings.pages_needed(16))
    data = eval_data(tok, settings, corpus.split("eval"))
    layers = [m for m in lm.modules() if isinstance(m, Attention)]
    kinds = ["sliding_attention" if m.spec.sliding_window else "full_attention" for m in layers]
    ref = measure(lm, data, settings)
    rows = [dict(variant="auto", ppl=ref.ppl, decode_ppl=ref.decode_ppl)]
    print(f"{args.model}: auto ppl {ref.ppl:.4f} decode {ref.decode_ppl:.4f}", flush=True)
    for variant in args.variants:
        fmts = layer_formats(variant, kinds)

        def hook(mod, a, kw, kf, vf):  # (q, k, v): k and v through their formats
            pos = get_forward_context().metadata_for(mod.spec).positions
            return (a[0], fake_quant(a[1], kf, pos), fake_quant(a[2], vf, pos), *a[3:]), kw

        hs = [m.register_forward_pre_hook(lambda mod, a, kw, f=f: hook(mod, a, kw, *f), with_kwargs=True)
              for m, f in zip(layers, fmts)]  # fmt: skip
        t0 = time.perf_counter()
        try:
            got = measure(lm, data, settings)
        finally:
            for h in hs:
                h.remove()
        pairs = [(a, b) for ta, tb in zip(got.tokens, ref.tokens) for a, b in zip(ta, tb)]
        prefix = [next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), len(ta))
                  for ta, tb in zip(got.tokens, ref.tokens)]  # fmt: skip
        r = dict(variant=variant, formats=fmts, ppl=got.ppl, decode_ppl=got.decode_ppl,
                 ppl_delta_pct=100 * (got.ppl / ref.ppl - 1), decode_delta_pct=100 * (got.decode_ppl / ref.decode_ppl - 1),
                 agreement=sum(a == b for a, b in pairs) / len(pairs) if pairs else None, prefix=prefix,
                 seconds=time.perf_counter() - t0)  # fmt: skip
        rows.append(r)
        print(f"{args.model}: {variant:28s} ppl {got.ppl:.4f} ({r['ppl_delta_pct']:+.2f}%) decode "
              f"{got.decode_ppl:.4f} ({r['decode_delta_pct']:+.2f}%) agreement {100 * (r['agreement'] or 0):.1f}% "
              f"prefix {'/'.join(map(str, prefix))} {r['seconds']:.0f} s", flush=True)  # fmt: skip
        if args.json:  # after every variant: a long sweep keeps what it measured
            out = dict(model=args.model, settings=vars(settings), quick=args.quick, rows=rows)
            args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
