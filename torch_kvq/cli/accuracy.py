"""``kvq accuracy``: per layer, what quantizing its KV cache costs.

On a trained model (``--model``): each layer quantized alone, its perplexity delta on the eval
text and a suggested config (``sensitivity.py``). On a tiny random-weight model: the FP8 error of
each layer's attention on a sample batch against bf16 (SQNR), a quick check of the path."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torch_kvq.cli.args import (
    SUBCOMMANDS,
    CommandError,
    add_model_args,
    check_out_paths,
    model_label,
)

PROMPT_LENS = (24, 9, 40, 17)
DEFAULT_THRESHOLD_DB = 30.0  # a copy of torch_kvq.debug.accuracy's, which imports torch
DEFAULT_THRESHOLD_PCT = 0.1  # a copy of torch_kvq.evaluation.sensitivity's (a test checks)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "accuracy",
        help=SUBCOMMANDS["accuracy"][1],
        description=(
            "Measure every attention layer in isolation on a sample batch: attention with FP8 k/v "
            "(the layer's scales, or calibrated ones) against attention with bf16 k/v."
        ),
    )
    add_model_args(p)
    p.add_argument(
        "--threshold-db",
        type=float,
        default=DEFAULT_THRESHOLD_DB,  # the same as torch_kvq.debug.accuracy's (a test checks)
        help="flag layers under this SQNR (default %(default)s)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="use amax/448 scales from the sample instead of the config's",
    )
    p.add_argument(
        "--plot", type=Path, default=None, help="write a PNG bar chart of SQNR by layer here"
    )
    p.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    trained = p.add_argument_group("a trained model (--model): measured on the eval text")
    trained.add_argument(
        "--mode",
        action="append",
        metavar="M",
        help="a quantized kv_cache_dtype to measure per layer (default fp8); repeatable, "
        "cheapest first: the suggestion gives each layer the first mode within the threshold",
    )
    trained.add_argument(
        "--threshold-pct",
        type=float,
        default=DEFAULT_THRESHOLD_PCT,
        help="a layer whose perplexity delta exceeds this %% is kept in the model dtype "
        "(default %(default)s)",
    )
    trained.add_argument(
        "--scales", type=Path, default=None, help="k/v scales (kvq calibrate's file); default 1.0"
    )
    trained.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    trained.add_argument("--windows", type=int, default=2, help="windows (default 2)")
    trained.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    trained.add_argument("--device", default="cpu")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        if args.calibrate or args.plot is not None:
            raise CommandError(
                "--calibrate / --plot are for the tiny models; on a trained model give scales "
                "with --scales (kvq calibrate --model writes them)"
            )
        from torch_kvq.cli import sensitivity

        return sensitivity.run(args)
    import torch

    from torch_kvq.cli.sources import kv_config_from_args, model_from_args
    from torch_kvq.debug.accuracy import layer_accuracy
    from torch_kvq.progress import Progress, activity

    check_out_paths(args.plot, args.json)
    kv = kv_config_from_args(args)
    with Progress("kvq accuracy") as bar:
        bar.update(status=f"building {model_label(args)}")
        model = model_from_args(args, kv)
        gen = torch.Generator().manual_seed(args.seed)
        prompts = [
            torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
            for n in PROMPT_LENS
        ]
        n = len(model.kv_specs)
        bar.update(status=f"one forward pass, then FP8 vs bf16 attention for each of {n} layers")
        report = layer_accuracy(model, prompts, kv, args.threshold_db, args.calibrate)
    if args.calibrate:
        scales = "calibrated from the sample (amax / 448)"
    else:
        scales = f"default k {kv.default_k_scale:g}, v {kv.default_v_scale:g}"
        if kv.kv_scales:
            scales += f", {len(kv.kv_scales)} per-layer"
    print(
        f"kvq accuracy: {model_label(args)}, {len(prompts)} prompts of "
        f"{', '.join(map(str, PROMPT_LENS))} tokens\n"
        f"your config: kv_cache_dtype {kv.kv_cache_dtype!r}, skip_layers {kv.skip_layers or 'none'}, "
        f"page_size {kv.page_size}; scales: {scales}"
    )
    print()
    print(report.format())
    try:
        if args.plot is not None:
            with activity("drawing the plot (matplotlib)"):
                report.plot(str(args.plot))
            print(f"plot: {args.plot}")
        if args.json is not None:
            args.json.write_text(report.to_json() + "\n")
            print(f"json: {args.json}")
    except OSError as e:
        raise CommandError(f"cannot write output: {e}") from e
    return 0
