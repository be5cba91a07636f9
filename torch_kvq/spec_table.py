"""The report side of the specs: the per-layer table, its notes and a stable text key.

Apart from ``spec`` and ``spec_resolve``: it only reads resolved ``LayerKVSpec``s, for people
(``kvq`` tables, notes) and for cache keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from torch_kvq.spec import LayerKVSpec

_TYPE_RULES = {  # rule -> (whether it matches a layer, what a model it matches none of has)
    "sliding_window": (True, "this model has no sliding-window layers"),
    "full_attention": (False, "every layer of this model has a sliding window"),
}


def skip_rule_notes(
    skip_layers: Iterable[int | str],
    specs: Sequence[LayerKVSpec],
    layer_modes: Iterable[tuple[int | str, str]] = (),
) -> list[str]:
    """Notes for the attention-type rules (``"sliding_window"``, ``"full_attention"``) that
    match no layer or every layer of a quantized model (``layer_modes`` ones: that match no
    layer). Not errors, unlike a glob that matches
    nothing: one config serves several models (a Llama has no sliding-window layers). But such a
    rule quantizes every layer, or keeps every layer unquantized, which a reader should see."""
    if not any(s.is_quantized or s.skip_reason for s in specs):
        return []  # the config quantizes nothing: no rule changed anything
    notes = []
    for rule in skip_layers:
        if rule not in _TYPE_RULES:
            continue
        sliding, what_none = _TYPE_RULES[rule]
        hits = sum((s.sliding_window is not None) == sliding for s in specs)
        if hits == 0:
            every = ": every layer is quantized" if all(s.is_quantized for s in specs) else ""
            notes.append(f"note: skip rule {rule!r} matches no layer ({what_none}){every}")
        elif hits == len(specs):
            what_all = _TYPE_RULES["full_attention" if sliding else "sliding_window"][1]
            notes.append(
                f"note: skip rule {rule!r} matches every layer ({what_all}): no layer is quantized"
            )
    for rule, mode in layer_modes:
        if rule in _TYPE_RULES:
            sliding, what_none = _TYPE_RULES[rule]
            if not any((s.sliding_window is not None) == sliding for s in specs):
                notes.append(
                    f"note: layer_modes rule {rule!r} (mode {mode!r}) matches no layer "
                    f"({what_none})"
                )
    return notes


def scale_notes(specs: Sequence[LayerKVSpec]) -> list[str]:
    """A note naming the quantized layers on scale 1.0 that nobody chose (no ``kv_scales`` entry,
    default scales left at 1.0): a scale never defaults silently."""
    idx = [s.index for s in specs if s.uncalibrated]
    if not idx:
        return []
    which = (
        "every quantized layer"
        if len(idx) == sum(s.is_quantized for s in specs)
        else ("layers " + ", ".join(map(str, idx)))
    )
    return [
        f"note: scale 1.0, uncalibrated: {which} (no kv_scales given); k / v beyond +-448 are "
        "clamped (an eager run warns); kvq calibrate writes scales, kv_scales_from= reads them"
    ]


def format_spec_table(
    specs: Sequence[LayerKVSpec],
    extra: Mapping[str, Mapping[str, str]] | None = None,
    *,
    columns: Sequence[str] | None = None,
    skip_layers: Iterable[int | str] = (),
    layer_modes: Iterable[tuple[int | str, str]] = (),
    notes: bool = True,
) -> str:
    """A readable per-layer table: every layer's mode by name, its cache dtype, the bytes a token
    takes (codes plus scales) and of them the scales'. ``extra`` adds columns per layer name (e.g.
    what was fused). ``columns``: the column names to show, in table order (None: all).
    ``skip_layers`` / ``layer_modes``: the config's rules. ``notes``: the notes of
    ``skip_rule_notes`` and ``scale_notes`` follow the table (False: the caller prints them)."""
    extra = extra or {}
    extra_cols = sorted({c for cols in extra.values() for c in cols})
    header = [
        "idx",
        "layer",
        "type",
        "mode",
        "cache dtype",
        "bytes/token",
        "scale bytes/token",
        "k_scale",
        "v_scale",
        *extra_cols,
    ]
    unknown = [c for c in columns or () if c not in header]
    if unknown:
        raise ValueError(f"unknown table columns {unknown}; the table has {header}")
    rows = []
    for s in specs:
        window = f"sliding({s.sliding_window})" if s.sliding_window else "global"
        rows.append(
            [
                str(s.index),
                s.name,
                window,
                s.mode.value,
                str(s.storage_dtype).replace("torch.", ""),
                str(s.cache_bytes_per_token),
                str(s.scale_bytes_per_token),
                k_cell(s),
                v_cell(s),
                *[extra.get(s.name, {}).get(c, "") for c in extra_cols],
            ]
        )
    keep = [i for i, h in enumerate(header) if columns is None or h in columns]
    header, rows = [header[i] for i in keep], [[r[i] for i in keep] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    table = [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]
    said = skip_rule_notes(skip_layers, specs, layer_modes) + scale_notes(specs) if notes else []
    return "\n".join(table + ([""] + said if said else []))


def k_cell(spec: LayerKVSpec) -> str:
    """The k_scale column: the per-tensor scale, ``per token``, or ``per token, channels`` and
    how (``scaled`` / ``scaled+centred``) for an int4 layer with K channel scales, or ``per
    group, basis`` and its digest for a tc4 layer."""
    if spec.k_channel is not None:
        return f"per token, channels {spec.k_channel.kind}"
    if spec.k_basis is not None:  # tc4: every such layer has one
        return f"per group, {spec.k_basis.label}"
    return "per token" if spec.mode.per_token_head else scale_cell(spec, spec.k_scale)


def v_cell(spec: LayerKVSpec) -> str:
    """The v_scale column: the per-tensor scale, ``per token``, or ``per group`` (tc4)."""
    if spec.mode.transform_coded:
        return "per group"
    return "per token" if spec.mode.per_token_head else scale_cell(spec, spec.v_scale)


def scale_cell(spec: LayerKVSpec, scale: float) -> str:
    """A per-tensor scale as the table shows it, marked when it is the uncalibrated 1.0."""
    return f"{scale:.4g}" + (" uncalibrated" if spec.uncalibrated else "")


def spec_table_key(specs: Iterable[LayerKVSpec]) -> str:
    """A stable text form of a spec table, for cache keys (``uuid()``) and reports."""
    return "\n".join(repr(sorted(s.as_dict().items())) for s in sorted(specs, key=lambda s: s.name))
