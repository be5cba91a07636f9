"""The per-layer plan for a model and config, without running the model (``kvq inspect``).

For each attention layer: type, mode, cache dtype, cache bytes per token, the kernel that serves
it on the chosen arch, and what the passes will fuse. The fusion column comes from the same
``KVQStamp`` decisions the passes use (``make_stamp`` + the capability table), so it cannot
disagree with what a compile does; whether the kernel serves a layer at all (arch, dtype, head
size, page size) comes from the same table its own ``check_supported`` reads. An arch the table
does not know is refused. A layer the kernel cannot serve is marked "NOT SERVED" (``not_served``
says why): a ``forward_context`` with that kernel would refuse the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real imports are inside the functions: importing this module is cheap
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
    "output quant: whether the kernel could fuse a static FP8 quant of the attention output, if\n"
    "the model has one; inspect does not trace the model, and the preset models have none (a\n"
    "compile reports 'not fused: no static FP8 quant of the attention output')."
)


def _output_quant(not_served: str | None, kv_block: str | None, out_block: str | None) -> str:
    """The ``output_quant`` cell: what the kernel could do, not what the model has."""
    if not_served is not None or kv_block is not None:
        return "not fused"  # the "will fuse" column says why
    if out_block is None:
        return "fusable if the model has one (kernel writes FP8 output)"
    return out_block.removeprefix("not fused: ")


def plan_columns(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """The plan's table columns per layer name: ``kernel``, ``will fuse``, ``output quant``."""
    keys = {"kernel": "kernel", "will fuse": "fuses", "output quant": "output_quant"}
    return {r["name"]: {column: r[key] for column, key in keys.items()} for r in rows}


def format_plan(
    specs: Sequence[LayerKVSpec],
    rows: Sequence[dict[str, Any]],
    skip_layers: Sequence[int | str] = (),
) -> str:
    """The per-layer table with the plan's columns, the skip-rule notes and the output-quant note."""
    from torch_kvq.spec_table import format_spec_table

    table = format_spec_table(specs, plan_columns(rows), skip_layers=skip_layers)
    return table + "\n\n" + OUTPUT_QUANT_NOTE


def format_caches(layers: Sequence[Any]) -> str:
    """The caches a built model holds (``kvq dump``'s plan.txt): per ``Attention`` layer its mode,
    ``kv_cache`` and ``kv_scale`` (dtype and shape: ``[pages, slots, page, KH, code_dim]``, slots 3
    for ``k8v4_per_token_head``, code_dim D / 2 for the 4-bit modes; ``[pages, 2, KH, page]``) and
    their bytes, which equal the spec's ``cache_bytes_per_token`` times pages times page size."""

    def cell(t: Any) -> str:
        return "-" if t is None else f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"

    header = ["layer", "mode", "kv_cache", "kv_scale", "bytes"]
    rows = [
        [
            a.spec.name,
            a.spec.mode.value,
            cell(a.kv_cache),
            cell(a.kv_scale),
            str(a.kv_cache.nbytes + (0 if a.kv_scale is None else a.kv_scale.nbytes)),
        ]
        for a in layers
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    total = sum(int(r[-1]) for r in rows)
    return "\n".join(
        [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows),
         f"total {total} bytes"]
    )  # fmt: skip
