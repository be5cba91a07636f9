"""``kvq inspect``: the per-layer plan for a model and config, without running the model.

For each attention layer: type, mode, cache dtype, cache bytes per token, the kernel that serves
it on the chosen arch, and what the passes will fuse. The fusion column comes from the same
``KVQStamp`` decisions the passes use (``make_stamp`` + the capability table), so it cannot
disagree with what a compile does.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from torch_kvq.attention.kernels import capabilities as caps
from torch_kvq.passes.manager import make_stamp
from torch_kvq.spec import LayerKVSpec, format_spec_table


def layer_plan(
    specs: Sequence[LayerKVSpec], kernel: str | None = None, arch: str = "cpu"
) -> list[dict[str, Any]]:
    """One row per layer: the spec's fields plus ``kernel``, ``fuses`` and ``output_quant``."""
    rows = []
    for spec in specs:
        stamp = make_stamp(spec, kernel or caps.default_kernel(arch), arch)
        kv_block, out_block = stamp.kv_block(), stamp.output_block()
        rows.append(
            {
                **spec.as_dict(),
                "attention_type": spec.attention_type,
                "cache_bytes_per_token": spec.cache_bytes_per_token,
                "kernel": stamp.kernel,
                "arch": arch,
                "fuses": "quant+write, dequant+attention" if kv_block is None else kv_block,
                "output_quant": "fusable (kernel writes FP8 output)"
                if out_block is None
                else "not fused",
            }
        )
    return rows


def format_plan(specs: Sequence[LayerKVSpec], rows: Sequence[dict[str, Any]]) -> str:
    extra = {
        r["name"]: {
            "kernel": r["kernel"],
            "will fuse": r["fuses"],
            "output quant": r["output_quant"],
        }
        for r in rows
    }
    return format_spec_table(specs, extra)


def add_parser(sub: Any) -> None:
    from torch_kvq.cli import add_model_args

    p = sub.add_parser(
        "inspect",
        help="print the per-layer plan (mode, cache dtype, bytes, kernel, fusions) without running",
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
        help=f"kernel name (default: per arch); known: {', '.join(caps.known_kernels())}",
    )
    p.add_argument(
        "--arch", default="cpu", help="device arch to plan for: cpu (default), sm90, ..."
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from torch_kvq.cli import kv_config_from_args, model_from_args

    kv = kv_config_from_args(args)
    model = model_from_args(args, kv, num_pages=1)  # weights are not used; one page per layer
    if args.kernel is not None:
        caps.capabilities(args.kernel, args.arch)  # ValueError naming the kernel / arch
    rows = layer_plan(model.kv_specs, args.kernel, args.arch)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    print(
        f"kvq inspect: preset {args.preset}, kv_cache_dtype={kv.kv_cache_dtype!r}, skip_layers={kv.skip_layers}, arch {args.arch}"
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
    return 0
