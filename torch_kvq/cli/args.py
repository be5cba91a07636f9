"""What every ``kvq`` subcommand shares: the subcommand table, ``CommandError``, and the options
that name a model and its KV config.

A model comes from one source, a mutually exclusive option group every subcommand has:
``--model SOURCE`` (a trained model: a shipped name, a GGUF file or an HF checkpoint folder; the
default of ``kvq demo``), ``--preset NAME`` (our tiny random-weight models, the other commands'
default), ``--hf FAMILY`` (a tiny random-weight transformers model) or ``--hf-config PATH`` (a
transformers config.json on the meta device, no weights). ``resolve_source`` fills in the
subcommand's default; ``sources.model_from_args`` builds it. No torch import here: building the parsers stays
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
        "per layer, what quantizing its KV cache costs (a trained model: perplexity), and a "
        "suggested config",
    ),
    "eval": (
        "torch_kvq.cli.eval",
        "perplexity and greedy agreement of trained models under KV configs, on real text",
    ),
    "calibrate": (
        "torch_kvq.cli.calibrate",
        "FP8 k/v scales of a trained model from a calibration text split",
    ),
}
# Copies of torch_kvq.models.PRESETS / torch_kvq.spec.SUPPORTED_PAGE_SIZES, so that building the
# parsers imports no torch (tests/cli/test_cli.py checks they match).
PRESET_NAMES: tuple[str, ...] = ("gemma3-tiny", "llama-tiny")
PAGE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_PRESET = "gemma3-tiny"
# A copy of torch_kvq.integrations.trained_sources.SHIPPED's names (tests/cli/test_cli.py checks
# they match).
SHIPPED_MODELS: tuple[str, ...] = ("gemma3-270m", "smollm2-135m")


class CommandError(Exception):
    """A subcommand's clean failure (no traceback): printed, exit code 2."""


def check_out_paths(*paths: object) -> None:
    """Output files (``--json``, ``--plot``, ...; None: not asked for) go into folders that exist:
    checked before any work, so a typo loses no run."""
    from pathlib import Path

    for path in paths:
        if path is not None and not Path(path).parent.is_dir():
            raise CommandError(
                f"folder {str(Path(path).parent)!r} for {str(path)!r} does not exist"
            )


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


def add_model_args(p: argparse.ArgumentParser, default_model: str | None = None) -> None:
    """The model source (``--model`` | ``--preset`` | ``--hf`` | ``--hf-config``) and the
    KV-config options. ``default_model``: the trained model used when no source is given (else
    the preset ``DEFAULT_PRESET``)."""
    from torch_kvq.integrations.hf_tiny import FAMILIES  # a table: no torch, no transformers

    default = f"--model {default_model}" if default_model else f"--preset {DEFAULT_PRESET}"
    source = p.add_argument_group(f"model (one of; default {default})")
    source = source.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        metavar="SOURCE",
        default=None,
        help=f"a trained model: {' or '.join(SHIPPED_MODELS)} (shipped in the models extra), a "
        ".gguf file or a local HF checkpoint folder",
    )
    source.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default=None,
        help="tiny model with fixed random weights (gemma3-tiny: 2 sliding : 1 global)",
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
        help="fp8 (default), auto, bfloat16, int8_per_token_head, fp8_per_token_head, "
        "int4_per_token_head, k8v4_per_token_head (k int8, v int4), tc4_per_token_head "
        "(transform-coded; needs --k-bases), ...",
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
    kv.add_argument(
        "--k-bases",
        metavar="PATH",
        default=None,
        help="the K bases tc4_per_token_head layers need (a kvq calibrate file; --model / --hf "
        "sources, whose layers it names)",
    )
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--seed", type=int, default=0, help="random weights and prompts")
    p.set_defaults(default_model=default_model)


def resolve_source(args: argparse.Namespace) -> None:
    """Fill in the subcommand's default source when the command line named none."""
    if not hasattr(args, "preset"):
        return
    if args.model is args.preset is args.hf is args.hf_config is None:
        if args.default_model is not None:
            args.model = args.default_model
        else:
            args.preset = DEFAULT_PRESET


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
    if args.model is not None:
        return f"trained model {args.model}"
    if args.hf_config is not None:
        return f"transformers config {args.hf_config} (meta device, no weights)"
    if args.hf is not None:
        return f"transformers {args.hf} (tiny, random weights)"
    return f"preset {args.preset}"
