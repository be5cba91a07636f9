"""Named KV-cache configurations, each chosen from measurements on the shipped trained models.

``int4-recommended`` is the recommended 4-bit map (docs/accuracy.md, "The recommended 4-bit
map"): ``int4_per_token_head`` on every full-attention layer but the ones where 4-bit keys cost
the model most, which get ``k8v4_per_token_head`` (k int8, v int4: the perplexity cost is in k;
greedy agreement loses more to v's 4 bits, docs/accuracy.md); sliding-window layers keep the
model dtype (small at long context, and their keys cost as much). Which
layers cost most is a measurement per model, not a position: on SmolLM2-135M they are spread
through the stack and the first and last layers are among the cheapest. The rule: a layer whose
perplexity delta with only that layer in rotated int4 exceeds 0.3% (for the shipped models
measured by ``benchmarks/int4_study.py``'s per-layer sweep, the resulting maps checked with
``kvq eval``; for another model ``kvq accuracy --mode int4_per_token_head --threshold-pct 0.3``
lists candidates, whose map wants the same check: single-layer deltas near the threshold are of
the order of the noise between text slices). ``KVPreset.measured`` holds them for the shipped
models; another model passes its own (``sensitive_layers``), and without them the preset raises
rather than guess.

``tc4-recommended`` is ``tc4_per_token_head`` on every full-attention layer, sliding-window
layers in the model dtype (docs/accuracy.md, "``tc4_per_token_head``: the transform-coded
mode"): it needs no per-model layer list, but each tc4 layer needs its K basis, calibrated per
model (``kvq calibrate``; ``--kv tc4-recommended:basis=calibrate`` in ``kvq eval``;
``from_hf(k_bases_from=)``): the preset's config carries none, and resolving it without them is
the ``ValueError`` that says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch_kvq.spec import KVCacheConfig


@dataclass(frozen=True)
class KVPreset:
    """A named map: ``kv_cache_dtype`` everywhere no rule selects, ``rules`` on every model,
    ``sensitive_mode`` on each model's ``measured`` layers (indices; None: no per-model layers);
    ``page_size``: the tokens a page its decode measured fastest at (the caller may pass
    another); ``tables``: the per-layer tables its layers take (``kvq eval``'s ``channels=`` /
    ``basis=`` options: K channel scales, K bases)."""

    name: str
    kv_cache_dtype: str
    rules: tuple[tuple[int | str, str], ...]
    sensitive_mode: str | None
    measured: Mapping[str, tuple[int, ...]]
    how_to_measure: str | None
    page_size: int
    tables: tuple[str, ...]


PRESETS: dict[str, KVPreset] = {
    "int4-recommended": KVPreset(
        name="int4-recommended",
        kv_cache_dtype="int4_per_token_head",
        rules=(("sliding_window", "auto"),),
        sensitive_mode="k8v4_per_token_head",
        # layers whose int4 delta alone exceeds 0.3% (docs/design/int4-branch.md, "Per layer")
        measured={"smollm2-135m": (1, 3, 4, 6, 12, 13, 16, 22), "gemma3-270m": (5, 11, 17)},
        how_to_measure="kvq accuracy --model M --mode int4_per_token_head --threshold-pct 0.3",
        # the 4-bit decode reads 32-token pages closer to copy bandwidth than 16-token ones
        # (docs/performance.md, "4-bit layers and the page size")
        page_size=32,
        tables=("channels",),
    ),
    "tc4-recommended": KVPreset(
        name="tc4-recommended",
        kv_cache_dtype="tc4_per_token_head",
        rules=(("sliding_window", "auto"),),
        sensitive_mode=None,
        measured={},
        how_to_measure=None,
        page_size=32,  # as the 4-bit decodes' (its TMA decode is theirs)
        tables=("basis",),
    ),
}


def kv_preset(
    name: str,
    *,
    model: str | None = None,
    sensitive_layers: Sequence[int] | None = None,
    page_size: int | None = None,
) -> KVCacheConfig:
    """The ``KVCacheConfig`` of preset ``name`` for ``model`` (a shipped model's name, e.g.
    ``smollm2-135m``), or for any model given its ``sensitive_layers``; ``page_size`` None: the
    preset's. ValueError naming the bad value: an unknown preset, or a model with no measurement
    and no layers given."""
    if name not in PRESETS:
        raise ValueError(f"unknown KV preset {name!r}; expected one of {sorted(PRESETS)}")
    preset = PRESETS[name]
    if preset.sensitive_mode is None:
        if sensitive_layers is not None:
            raise ValueError(
                f"KV preset {name!r} takes no sensitive layers (got {list(sensitive_layers)}): "
                "its map is the same on every model"
            )
        sensitive_layers = ()
    elif sensitive_layers is None:
        if model not in preset.measured:
            raise ValueError(
                f"KV preset {name!r} has no measured layers for model {model!r} (measured: "
                f"{sorted(preset.measured)}); measure them with `{preset.how_to_measure}` and "
                "pass sensitive_layers= (the layers it keeps in the model dtype; check the map "
                "with kvq eval)"
            )
        sensitive_layers = preset.measured[model]
    sensitive = tuple((int(i), str(preset.sensitive_mode)) for i in sensitive_layers)
    return KVCacheConfig(
        kv_cache_dtype=preset.kv_cache_dtype,
        layer_modes=preset.rules + sensitive,
        page_size=preset.page_size if page_size is None else page_size,
    )
