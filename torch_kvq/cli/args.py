"""What every ``kvq`` subcommand shares: the subcommand table, ``CommandError``, and the options
that name a model and its KV config.

A model comes from one source, a mutually exclusive option group every subcommand has:
``--preset NAME`` (our tiny models, the default), ``--hf FAMILY`` (a tiny random-weight
transformers model) or ``--hf-config PATH`` (a transformers config.json on the meta device, no
weights). ``sources.model_from_args`` builds it. No torch import here: building the parsers stays
fast (``kvq --help``).
"""

from __future__ import annotations

import argparse

SUBCOMMANDS: dict[str, tuple[str, str]] = {  # name -> (module, the help its add_parser gives)
    "demo": (
        "torch_kvq.cli.demo",
        "generate with a small mixed FP8/bf16 KV-cache model and compare to all-bf16",
    ),
    "inspect": (
        "torch_kvq.cli.inspect",
        "print the per-layer plan (mode, cache dtype, bytes, kernel, fusions) without running",
    ),
    "dump": (
        "torch_kvq.cli.dump",
        "compile a model with kvq_backend and write per-pass dumps, diffs, SVGs, depyf files",
    ),
    "accuracy": (
        "torch_kvq.cli.accuracy",
        "per-layer FP8 error vs the bf16 reference (max abs, relative, SQNR), suggested "
        "skip_layers",
    ),
}
# Copies of torch_kvq.models.PRESETS / torch_kvq.spec.SUPPORTED_PAGE_SIZES, so that building the
# parsers imports no torch (tests/test_cli.py checks they match).
PRESET_NAMES: tuple[str, ...] = ("gemma3-tiny", "llama-tiny")
PAGE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_PRESET = "gemma3-tiny"


class CommandError(Exception):
    """A subcommand's clean failure (no traceback): printed, exit code 2."""


def skip_rule(text: str) -> int | str:
    """``--skip`` values: an int layer index (``-1`` is the last layer) or a rule / name string."""
    try:
        return int(text)
    except ValueError:
        return text


def kv_map(text: str) -> tuple[tuple[int | str, str], ...]:
    """``--kv-map``: ``evaluation.kv_arg.parse_kv_map`` as an argparse ``type``."""
    from torch_kvq.evaluation.kv_arg import parse_kv_map  # torch-free

    try:
        return parse_kv_map(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
    """An argparse ``type`` for options that take a positive int."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model source (``--preset`` | ``--hf`` | ``--hf-config``) and the KV-config options."""
    from torch_kvq.integrations.hf_tiny import FAMILIES  # a table: no torch, no transformers

    source = p.add_argument_group("model (one of)").add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default=DEFAULT_PRESET,
        help="tiny model with fixed random weights (default %(default)s: 2 sliding : 1 global)",
    )
    source.add_argument(
        "--hf",
        metavar="FAMILY",
        choices=sorted(FAMILIES),
        default=None,
        help=f"a tiny random-weight transformers model of this family ({', '.join(FAMILIES)})",
    )
    source.add_argument(
        "--hf-config",
        metavar="PATH",
        default=None,
        help="a transformers config.json (or a folder with one), built on the meta device "
        "without weights (nothing is downloaded); kvq inspect only",
    )
    kv = p.add_argument_group("KV cache config")
    kv.add_argument(
        "--kv-cache-dtype",
        default="fp8",
        help="fp8 (default), auto, bfloat16, int8_per_token_head, fp8_per_token_head, ...",
    )
    skip = kv.add_mutually_exclusive_group()
    skip.add_argument(
        "--skip",
        action="append",
        type=skip_rule,
        metavar="RULE",
        help="skip rule, repeatable: a layer index, 'sliding_window', 'full_attention', a name or "
        "glob (default: sliding_window)",
    )
    skip.add_argument("--no-skip", action="store_true", help="quantize every layer")
    kv.add_argument(
        "--kv-map",
        type=kv_map,
        metavar="MAP",
        default=None,
        help="a per-layer mode map, e.g. '0-3:fp8,4-35:int8_per_token_head,sliding_window:auto' "
        "(RULE:MODE entries; a rule is an index, a range A-B, sliding_window, full_attention, a "
        "name or glob); layers it leaves out take --kv-cache-dtype; with a map, no layer is "
        "skipped by default (--skip adds skip rules)",
    )
    kv.add_argument("--page-size", type=int, choices=PAGE_SIZES, default=16)
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--seed", type=int, default=0, help="random weights and prompts")


def add_wide_arg(p: argparse.ArgumentParser) -> None:
    """``--wide``: every column of the per-layer tables (the default fits 100 columns)."""
    p.add_argument(
        "--wide",
        action="store_true",
        help="print every column of the per-layer tables (default: the columns that fit a "
        "100-column terminal, the rest summarized below the table)",
    )


def model_label(args: argparse.Namespace) -> str:
    """How the model source options name the model."""
    if args.hf_config is not None:
        return f"transformers config {args.hf_config} (meta device, no weights)"
    if args.hf is not None:
        return f"transformers {args.hf} (tiny, random weights)"
    return f"preset {args.preset}"
