"""``kvq calibrate``: static FP8 k/v scales of a trained model from the corpus's calibration split
(``torch_kvq.evaluation.calibrate``), written where ``kv_scales_from=`` / ``--kv fp8:scales=``
read them; beside them, each layer's K channel scales for ``int4_per_token_head``
(``P.k_channel_scale`` / ``P.k_channel_mean``, read by ``k_channels_from=`` /
``--kv int4_per_token_head:channels=``) and K bases (``P.k_basis``, read by ``k_bases_from=`` /
``--kv tc4_per_token_head:basis=``), except with ``--stats-from`` (they need the model).

Usage: ``kvq calibrate --model gemma3-270m --out gemma_kv_scales.safetensors``.

Flags:
  --model SOURCE       a shipped model name (smollm2-135m, gemma3-270m), a .gguf file or a local
                       HF checkpoint folder (default gemma3-270m)
  --out PATH           the safetensors file to write (``P.k_scale`` / ``P.v_scale`` per layer,
                       ``P.k_channel_scale`` / ``P.k_channel_mean`` [KH, D])
  --statistic S        amax (default) or a percentile of |x|, e.g. p99.99
  --headroom H         multiply the statistic by H before dividing by 448 (default 2: room for
                       text the sample did not see; --headroom 1 --no-pow2 is plain amax / 448)
  --no-pow2            keep the exact statistic * headroom / 448 (default: round the scale up to a
                       power of two, which keeps scale 1.0's rounding grid; see docs/accuracy.md)
  --only k|v           calibrate k (or v) only; the other gets scale 1.0 (for experiments)
  --multiplier M       multiply every written scale by M (for experiments: grid alignment)
  --window N --windows N
                       the calibration sample: N windows of N tokens from the calibration split
                       (default 1024, 4)
  --dtype D --device D float32 (default) | bfloat16 | float16; cpu (default) | cuda
  --stats-json PATH    also write the per-layer statistics (amax, percentiles, clipped fraction)
  --stats-from PATH    read the statistics a --stats-json run wrote instead of running the model
                       (to try several methods on one sample; --model and the sample flags are
                       then not used)
Bad input: ``kvq calibrate: error: ...``, exit code 2 (``torch_kvq.cli.main``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch_kvq.cli.args import SUBCOMMANDS, check_out_paths

# evaluation.calibrate.DEFAULT_METHOD's headroom (not imported here: that module imports torch)
DEFAULT_HEADROOM = 2.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate",
        help=SUBCOMMANDS["calibrate"][1],
        description="Calibrate per-layer FP8 k/v scales of a trained model on the Brown Corpus "
        "calibration split and write them in the compressed-tensors layout.",
    )
    p.add_argument("--model", default="gemma3-270m", metavar="SOURCE")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--statistic", default="amax")
    p.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM)
    p.add_argument("--no-pow2", dest="pow2", action="store_false")
    p.add_argument("--only", choices=("k", "v"), default=None)
    p.add_argument("--multiplier", type=float, default=1.0)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--stats-json", type=Path, default=None)
    p.add_argument("--stats-from", type=Path, default=None)
    p.set_defaults(func=run)


def _sample(args: argparse.Namespace, percentiles: list[str]):  # -> (stats, meta, tables)
    """Run the model over the calibration windows: per-layer statistics and what they came from."""
    from torch_kvq.cli.sources import trained_for_text
    from torch_kvq.evaluation import corpus
    from torch_kvq.evaluation.calibrate import k_bases, k_channel_scales, kv_stats
    from torch_kvq.evaluation.eval import EvalSettings, eval_data
    from torch_kvq.progress import Progress

    settings = EvalSettings(
        window=args.window, windows=args.windows, decode_tokens=0, prompts=1, prompt_tokens=1
    )
    with Progress("kvq calibrate") as bar:
        bar.update(status=f"loading {args.model}")
        lm, tok = trained_for_text(args, settings.pages_needed(args.page_size))
        data = eval_data(tok, settings, corpus.split("calibration"))
        bar.update(status=f"{args.windows} windows of {args.window} tokens through the model")
        stats = kv_stats(lm, data.windows, percentiles)
        bar.update(status="the same windows for K channel scales")
        channels = k_channel_scales(lm, data.windows)
        bar.update(status="the same windows for K bases")
        bases = k_bases(lm, data.windows)
    meta = {
        "model": str(args.model),
        "dtype": args.dtype,
        "calibration_texts": ",".join(data.window_files),
        "tokens_per_text": str(args.window),
    }
    return stats, meta, (channels, bases)


def _read_stats(path: Path):  # -> (stats, meta, (None, None))
    from torch_kvq.evaluation.calibrate import LayerStats

    try:
        doc = json.loads(path.read_text())
        stats = {
            p: LayerStats(k=d["k"], v=d["v"], clipped_at_1=tuple(d["clipped_at_1"]))
            for p, d in doc["layers"].items()
        }
        return stats, dict(doc["meta"]), (None, None)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--stats-from {str(path)!r}: not a --stats-json file ({e})") from None


def run(args: argparse.Namespace) -> int:
    from torch_kvq.evaluation.calibrate import Method, scales_from_stats, write_scales
    from torch_kvq.spec import check_scale

    check_out_paths(args.out, args.stats_json)
    check_scale(args.multiplier, "--multiplier")
    method = Method(args.statistic, args.headroom, args.pow2)
    if args.stats_from is not None:
        stats, meta, (channels, bases) = _read_stats(args.stats_from)
    else:
        percentiles = sorted({"p99.9", "p99.99"} | ({method.statistic} - {"amax"}))
        stats, meta, (channels, bases) = _sample(args, percentiles)
    scales = scales_from_stats(stats, method)
    scales = {
        p: (
            1.0 if args.only == "v" else k * args.multiplier,
            1.0 if args.only == "k" else v * args.multiplier,
        )
        for p, (k, v) in scales.items()
    }
    written = {
        **meta,
        "method": method.label(),
        "only": args.only or "k and v",
        "multiplier": repr(args.multiplier),
    }
    write_scales(scales, args.out, written, k_channels=channels, k_bases=bases)
    print(
        f"kvq calibrate: {meta['model']}, {method.label()}"
        f"{f', {args.only} only' if args.only else ''}"
        f"{f', x {args.multiplier:g}' if args.multiplier != 1 else ''}; {len(scales)} layers from "
        f"{meta['calibration_texts']} ({meta['tokens_per_text']} tokens each)"
    )
    for path, (k, v) in scales.items():
        st = stats[path]
        print(
            f"  {path:40s} k_scale {k:.6g} (amax {st.k['amax']:.4g})  "
            f"v_scale {v:.6g} (amax {st.v['amax']:.4g})"
        )
    if channels:
        print(
            f"  K channel scales (int4_per_token_head), scaled and centred, for {len(channels)} "
            "layers: s_c^2 = rms(k_c) / rms(q_c) per kv head and channel"
        )
    if bases:
        print(
            f"  K bases (tc4_per_token_head) for {len(bases)} layers: k's and q's second moments "
            "balanced and sorted, the groups' rotations folded in"
        )
    print(f"wrote {args.out}")
    if args.stats_json is not None:
        doc = {"meta": meta, "layers": {p: asdict(s) for p, s in stats.items()}}
        args.stats_json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0
