"""``kvq inspect``: the per-layer plan (``debug.plan``) for a model and config, without running it.

A layer the kernel cannot serve is shown as "NOT SERVED" and the command then fails (exit 2): a
``forward_context`` with that kernel would refuse the model. ``--hf-config`` plans a transformers
config on the meta device (no weights).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from torch_kvq.cli.args import SUBCOMMANDS, CommandError, add_model_args, add_wide_arg, model_label


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help=SUBCOMMANDS["inspect"][1],
        description=(
            "Print, per attention layer, the attention type, KV quant mode, cache dtype, cache "
            "bytes per token, the kernel serving it on --arch, and what the passes will fuse. "
            "Nothing runs: the fusion column comes from the same decisions the passes make."
        ),
    )
    add_model_args(p)
    p.add_argument(
        "--kernel",
        default=None,
        help="kernel name (default: a per-arch default, for display: reference on cpu, "
        "flashinfer on GPUs); an unknown name is refused with the list of known ones",
    )
    p.add_argument(
        "--arch",
        default="cpu",
        help="device arch to plan for (default cpu); an unknown arch is refused with the list "
        "of known ones",
    )
    p.add_argument(
        "--head-dim", type=int, default=None, help="override the model's head size (e.g. 128)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_wide_arg(p)
    p.set_defaults(func=run)


def unserved_error(rows: Sequence[dict[str, Any]]) -> CommandError | None:
    """The error ``kvq inspect`` exits with when its kernel cannot serve some layers, else None."""
    bad = [r for r in rows if r["not_served"]]
    if not bad:
        return None
    return CommandError(
        f"kernel {bad[0]['kernel']!r} on {bad[0]['arch']} cannot serve {len(bad)} of {len(rows)} "
        f"layers (layer {bad[0]['name']!r}: {bad[0]['not_served']}); forward_context(...) with "
        "it would raise KernelUnsupportedError. Choose another --kernel or --arch"
    )


def run(args: argparse.Namespace) -> int:
    import sys

    from torch_kvq.attention.kernels import capabilities as caps
    from torch_kvq.cli.sources import kv_config_from_args, model_from_args
    from torch_kvq.cli.tables import layer_table
    from torch_kvq.debug.plan import OUTPUT_QUANT_NOTE, layer_plan, plan_columns
    from torch_kvq.spec_table import skip_rule_notes

    caps.check_arch(args.arch)  # ValueError listing the known archs
    kv = kv_config_from_args(args)
    # weights are not used (--hf-config: none, on the meta device); one page per layer
    model = model_from_args(args, kv, num_pages=1, weights=False)
    if args.kernel is not None:
        caps.capabilities(args.kernel, args.arch)  # ValueError naming the kernel / arch
    specs = model.kv_specs
    rows = layer_plan(specs, args.kernel, args.arch)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        for note in skip_rule_notes(kv.skip_layers, specs, kv.layer_modes):  # stdout stays JSON
            print(f"kvq inspect: {note}", file=sys.stderr)
    else:
        kernel = f"{rows[0]['kernel']} on {args.arch}" + (
            " (the default shown; compiles never pick one: choose with --kernel)"
            if args.kernel is None
            else ""
        )
        hf = getattr(model, "hf", None)
        print(f"kvq inspect: {model_label(args)}" + (f", {type(hf).__name__}" if hf else ""))
        print(f"kernel {kernel}")
        print(
            f"KV config: kv_cache_dtype={kv.kv_cache_dtype!r}, skip_layers={kv.skip_layers}"
            + (f", layer_modes={kv.layer_modes}" if kv.layer_modes else "")
        )
        print()
        table = layer_table(
            specs,
            plan_columns(rows),
            kv.skip_layers,
            wide=args.wide,
            also=("bytes/token",),
            layer_modes=kv.layer_modes,
        )
        print(table)
        print()
        print(OUTPUT_QUANT_NOTE)
        q = sum(1 for s in specs if s.is_quantized)
        full = sum(2 * s.num_kv_heads * s.head_size * s.model_dtype.itemsize for s in specs)
        print()
        print(
            f"{q} of {len(specs)} layers quantized; KV bytes per token (all layers): "
            f"{sum(s.cache_bytes_per_token for s in specs)} "
            f"(all-{str(model.dtype).replace('torch.', '')}: {full})"
        )
    err = unserved_error(rows)
    if err is not None:
        raise err
    return 0
