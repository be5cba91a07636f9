"""What every ``kvq`` subcommand shares: the subcommand table, ``CommandError``, and the model /
KV-config options with the functions that read them back.

The subcommand modules (``demo``, ``debug/*``, ``integrations/hf_cli``) import these from here,
never from ``cli.py``, which sits above them. No torch import at module level: building parsers
stays fast (``kvq --help``).
"""

from __future__ import annotations

import argparse

SUBCOMMANDS: dict[str, tuple[str, str]] = {  # name -> (module, the help its add_parser gives)
    "demo": (
        "torch_kvq.demo",
        "generate with a small mixed FP8/bf16 KV-cache model and compare to all-bf16",
    ),
    "inspect": (
        "torch_kvq.debug.plan",
        "print the per-layer plan (mode, cache dtype, bytes, kernel, fusions) without running",
    ),
    "dump": (
        "torch_kvq.debug.dump",
        "compile a model with kvq_backend and write per-pass dumps, diffs, SVGs, depyf files",
    ),
    "accuracy": (
        "torch_kvq.debug.accuracy_cmd",
        "per-layer FP8 error vs the bf16 reference (max abs, relative, SQNR), suggested "
        "skip_layers",
    ),
}
# Copies of torch_kvq.models.PRESETS / torch_kvq.spec.SUPPORTED_PAGE_SIZES, so that building the
# parsers imports no torch (tests/test_cli.py checks they match).
PRESET_NAMES: tuple[str, ...] = ("gemma3-tiny", "llama-tiny")
PAGE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)


class CommandError(Exception):
    """A subcommand's clean failure (no traceback): printed, exit code 2."""


def skip_rule(text: str) -> int | str:
    """``--skip`` values: an int layer index (``-1`` is the last layer) or a rule / name string."""
    try:
        return int(text)
    except ValueError:
        return text


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model / KV-config options shared by ``inspect``, ``dump`` and ``accuracy``."""
    p.add_argument(
        "--preset",
        choices=PRESET_NAMES,
        default="gemma3-tiny",
        help="tiny model with fixed random weights (default %(default)s: 2 sliding : 1 global)",
    )
    p.add_argument("--kv-cache-dtype", default="fp8", help="fp8 (default), auto, bfloat16, ...")
    skip = p.add_mutually_exclusive_group()
    skip.add_argument(
        "--skip",
        action="append",
        type=skip_rule,
        metavar="RULE",
        help="skip rule, repeatable: a layer index, 'sliding_window', 'full_attention', a name or "
        "glob (default: sliding_window)",
    )
    skip.add_argument("--no-skip", action="store_true", help="quantize every layer")
    p.add_argument("--page-size", type=int, choices=PAGE_SIZES, default=16)
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--seed", type=int, default=0, help="random weights and prompts")


def kv_config_from_args(args: argparse.Namespace):  # -> KVCacheConfig
    from torch_kvq.spec import KVCacheConfig

    skip = () if args.no_skip else tuple(args.skip or ("sliding_window",))
    return KVCacheConfig(
        kv_cache_dtype=args.kv_cache_dtype, skip_layers=skip, page_size=args.page_size
    )


def model_label(args: argparse.Namespace) -> str:
    """How the shared options name the model: ``preset X`` or ``transformers FAMILY (tiny)``."""
    hf = getattr(args, "hf", None)
    return f"transformers {hf} (tiny, random weights)" if hf else f"preset {args.preset}"


def model_from_args(args: argparse.Namespace, kv_config=None, num_pages: int = 64, tp=None):
    """Build the preset model the shared options describe (ValueError on bad config); ``tp``: this
    rank's tensor-parallel shard (``torch_kvq.distributed.TensorParallel``)."""
    from torch_kvq.models import build_model

    overrides = {}
    if args.layers is not None:
        if args.layers < 1:
            raise CommandError(f"--layers must be a positive int, got {args.layers}")
        overrides["num_hidden_layers"] = args.layers
        if args.preset.startswith("gemma3"):
            overrides["layer_types"] = [
                "full_attention" if i % 3 == 2 else "sliding_attention" for i in range(args.layers)
            ]
    head_dim = getattr(args, "head_dim", None)  # only ``kvq inspect`` has --head-dim
    if head_dim is not None:
        if head_dim < 1:
            raise CommandError(f"--head-dim must be a positive int, got {head_dim}")
        overrides["head_dim"] = head_dim
    kv = kv_config if kv_config is not None else kv_config_from_args(args)
    if getattr(args, "hf", None) is not None:  # ``kvq dump / accuracy --hf FAMILY``
        if tp is not None:
            raise CommandError("--tp runs the presets; --hf models take tp= in KVQCausalLM.from_hf")
        from torch_kvq.integrations.hf_cli import tiny_lm

        return tiny_lm(args.hf, kv, args.seed, num_pages, overrides)
    return build_model(args.preset, kv, seed=args.seed, num_pages=num_pages, tp=tp, **overrides)


def positive_int(text: str) -> int:
    """An argparse ``type`` for options that take a positive int."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value
