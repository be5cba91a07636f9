"""``kvq inspect``: the per-layer plan for a model and config, without running the model.

For each attention layer: type, mode, cache dtype, cache bytes per token, the kernel that serves
it on the chosen arch, and what the passes will fuse. The fusion column comes from the same
``KVQStamp`` decisions the passes use (``make_stamp`` + the capability table), so it cannot
disagree with what a compile does; whether the kernel serves a layer at all (arch, dtype, head
size, page size) comes from the same table its own ``check_supported`` reads. An arch the table
does not know is refused. A layer the kernel cannot serve is shown as "NOT SERVED" and the
command then fails (exit 2): a ``forward_context`` with that kernel would refuse the model.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real imports are inside the functions: ``kvq --help`` imports no torch
    from torch_kvq.cli_args import CommandError
    from torch_kvq.spec import LayerKVSpec


def layer_plan(
    specs: Sequence[LayerKVSpec], kernel: str | None = None, arch: str = "cpu"
) -> list[dict[str, Any]]:
    """One row per layer: the spec's fields plus ``kernel``, ``default_kernel`` (True when
    ``kernel`` is None and ``capabilities.default_kernel(arch)`` was shown), ``not_served`` (why
    the kernel cannot serve the layer, else None), ``fuses`` and ``output_quant`` (whether the
    kernel could fuse an output quant: ``layer_plan`` does not know if the model has one). ValueError for
    an arch the capability table does not know, or one the kernel has no row for."""
    from torch_kvq.attention.kernels import capabilities as caps
    from torch_kvq.passes.stamp import make_stamp

    caps.check_arch(arch)
    name = kernel or caps.default_kernel(arch)
    rows = []
    for spec in specs:
        why = caps.unsupported_reason(name, arch, spec)
        stamp = make_stamp(spec, name, arch)
        kv_block, out_block = stamp.kv_block(), stamp.output_block()
        fuses = "quant+write, dequant+attention" if kv_block is None else kv_block
        rows.append(
            {
                **spec.as_dict(),
                "attention_type": spec.attention_type,
                "cache_bytes_per_token": spec.cache_bytes_per_token,
                "kernel": stamp.kernel,
                "default_kernel": kernel is None,
                "arch": arch,
                "not_served": why,
                "fuses": f"NOT SERVED: {why}" if why else fuses,
                "output_quant": _output_quant(why, kv_block, out_block),
            }
        )
    return rows


OUTPUT_QUANT_NOTE = (
    "output quant: whether the kernel could fuse a static FP8 quant of the attention output, if "
    "the model has one;\ninspect does not trace the model, and the preset models have none (a "
    "compile reports 'not fused: no static FP8 quant of the attention output')."
)


def _output_quant(not_served: str | None, kv_block: str | None, out_block: str | None) -> str:
    """The ``output_quant`` cell: what the kernel could do, not what the model has."""
    if not_served is not None or kv_block is not None:
        return "not fused"  # the "will fuse" column says why
    if out_block is None:
        return "fusable if the model has one (kernel writes FP8 output)"
    return out_block.removeprefix("not fused: ")


def unserved_error(rows: Sequence[dict[str, Any]]) -> CommandError | None:
    """The error ``kvq inspect`` exits with when its kernel cannot serve some layers, else None."""
    from torch_kvq.cli_args import CommandError

    bad = [r for r in rows if r["not_served"]]
    if not bad:
        return None
    return CommandError(
        f"kernel {bad[0]['kernel']!r} on {bad[0]['arch']} cannot serve {len(bad)} of {len(rows)} "
        f"layers (layer {bad[0]['name']!r}: {bad[0]['not_served']}); forward_context(...) with "
        "it would raise KernelUnsupportedError. Choose another --kernel or --arch"
    )


def format_plan(specs: Sequence[LayerKVSpec], rows: Sequence[dict[str, Any]]) -> str:
    from torch_kvq.spec import format_spec_table

    extra = {
        r["name"]: {
            "kernel": r["kernel"],
            "will fuse": r["fuses"],
            "output quant": r["output_quant"],
        }
        for r in rows
    }
    return format_spec_table(specs, extra) + "\n\n" + OUTPUT_QUANT_NOTE


def add_parser(sub: Any) -> None:
    from torch_kvq.cli_args import SUBCOMMANDS, add_model_args

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
        "--head-dim", type=int, default=None, help="override the preset's head size (e.g. 128)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from torch_kvq.attention.kernels import capabilities as caps
    from torch_kvq.cli_args import kv_config_from_args, model_from_args

    caps.check_arch(args.arch)  # ValueError listing the known archs
    kv = kv_config_from_args(args)
    model = model_from_args(args, kv, num_pages=1)  # weights are not used; one page per layer
    if args.kernel is not None:
        caps.capabilities(args.kernel, args.arch)  # ValueError naming the kernel / arch
    rows = layer_plan(model.kv_specs, args.kernel, args.arch)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        err = unserved_error(rows)
        if err is not None:
            raise err
        return 0
    kernel = rows[0]["kernel"] + (
        f" (the default shown for {args.arch}; compiles never pick one: choose with --kernel)"
        if args.kernel is None
        else ""
    )
    print(
        f"kvq inspect: preset {args.preset}, kv_cache_dtype={kv.kv_cache_dtype!r}, "
        f"skip_layers={kv.skip_layers}, arch {args.arch}, kernel {kernel}"
    )
    print()
    print(format_plan(model.kv_specs, rows))
    q = sum(1 for s in model.kv_specs if s.is_quantized)
    print()
    print(
        f"{q} of {len(model.kv_specs)} layers quantized; KV bytes per token (all layers): "
        f"{sum(s.cache_bytes_per_token for s in model.kv_specs)} "
        f"(all-{str(model.dtype).replace('torch.', '')}: "
        f"{sum(2 * s.num_kv_heads * s.head_size * s.model_dtype.itemsize for s in model.kv_specs)})"
    )
    err = unserved_error(rows)
    if err is not None:
        raise err
    return 0
