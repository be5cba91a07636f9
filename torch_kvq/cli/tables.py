"""The per-layer tables ``kvq inspect`` and ``kvq demo`` print: by default the columns that fit a
100-column terminal, every other column summarized below as ``value: layers ...`` lines, then the
skip-rule notes (``spec_table.skip_rule_notes``); ``--wide`` prints every column instead."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch_kvq.spec import LayerKVSpec

WIDTH = 100  # the terminal the default output fits
NARROW = ("idx", "layer", "type", "mode", "cache dtype")  # the spec columns always shown


def layer_table(
    specs: Sequence[LayerKVSpec],
    extra: Mapping[str, Mapping[str, str]],
    skip_layers: Iterable[int | str],
    *,
    wide: bool,
    also: Sequence[str] = (),
    layer_modes: Iterable[tuple[int | str, str]] = (),
) -> str:
    """The table of ``specs`` with ``extra``'s columns; narrow (``wide`` False): the ``NARROW``
    columns and ``also``, each other ``extra`` column as grouped lines. ``skip_layers`` /
    ``layer_modes``: the config's rules, for the notes below the table."""
    from torch_kvq.spec_table import format_spec_table, scale_notes, skip_rule_notes

    rules, modes = tuple(skip_layers), tuple(layer_modes)
    if wide:
        return format_spec_table(specs, extra, skip_layers=rules, layer_modes=modes)
    out = [format_spec_table(specs, extra, columns=(*NARROW, *also), notes=False), ""]
    index = {s.name: s.index for s in specs}
    folded = [c for c in dict.fromkeys(c for cols in extra.values() for c in cols) if c not in also]
    for column in folded:  # in the order the columns were given
        groups: dict[str, list[int]] = {}
        for name, cols in extra.items():
            if column in cols:
                groups.setdefault(cols[column], []).append(index[name])
        out.append(f"{column}:")
        for value, layers in groups.items():
            text = f"{value}: {layer_list(layers, len(specs))}"
            out.append(textwrap.fill(text, WIDTH, initial_indent="  ", subsequent_indent="    "))
    out.append("(--wide: every column of the table, these too)")
    notes = [
        textwrap.fill(n, WIDTH, subsequent_indent="      ")
        for n in skip_rule_notes(rules, specs, modes) + scale_notes(specs)
    ]
    return "\n".join(out + ([""] + notes if notes else []))


def layer_list(indices: Iterable[int], total: int) -> str:
    """``layers 0, 1, 3-5`` (``every layer`` when all ``total`` are there)."""
    idx = sorted(indices)
    if len(idx) == total:
        return "every layer"
    runs: list[list[int]] = []
    for i in idx:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts = [f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs]
    return ("layer " if len(idx) == 1 else "layers ") + ", ".join(parts)
