"""``kvq accuracy``: per-layer error of the FP8 KV path against the bf16 reference."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from torch_kvq.debug.accuracy import DEFAULT_THRESHOLD_DB, layer_accuracy

PROMPT_LENS = (24, 9, 40, 17)


def add_parser(sub: Any) -> None:
    from torch_kvq.cli import add_model_args

    p = sub.add_parser(
        "accuracy",
        help="per-layer FP8 error vs the bf16 reference (max abs, relative, SQNR), suggested skip_layers",
        description=(
            "Measure every attention layer in isolation on a sample batch: attention with FP8 k/v "
            "(the layer's scales, or calibrated ones) against attention with bf16 k/v."
        ),
    )
    add_model_args(p)
    p.add_argument(
        "--threshold-db",
        type=float,
        default=DEFAULT_THRESHOLD_DB,
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from torch_kvq.cli import CommandError, kv_config_from_args, model_from_args, model_label

    for path in (args.plot, args.json):
        if path is not None and not path.parent.is_dir():
            raise CommandError(f"folder {str(path.parent)!r} for {str(path)!r} does not exist")
    kv = kv_config_from_args(args)
    model = model_from_args(args, kv)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS
    ]
    report = layer_accuracy(model, prompts, kv, args.threshold_db, args.calibrate)
    print(
        f"kvq accuracy: {model_label(args)}, {len(prompts)} prompts of {PROMPT_LENS} tokens, kv config {kv}"
    )
    print()
    print(report.format())
    try:
        if args.plot is not None:
            report.plot(str(args.plot))
            print(f"plot: {args.plot}")
        if args.json is not None:
            args.json.write_text(report.to_json() + "\n")
            print(f"json: {args.json}")
    except OSError as e:
        raise CommandError(f"cannot write output: {e}") from e
    return 0
