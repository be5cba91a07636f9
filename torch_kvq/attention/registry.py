"""Process-wide map from attention layer name to its live ``Attention`` module.

The compile backend resolves layer names in the graph through it (an unknown name is an error).
Names are unique among live layers: two models in one process get distinct prefixes.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch_kvq.attention.layer import Attention
    from torch_kvq.spec import LayerKVSpec

_layers: dict[str, weakref.ref[Attention]] = {}


def register(layer: Attention) -> None:
    """Register ``layer`` under ``layer.spec.name``; a live other layer with that name is an error."""
    name = layer.spec.name
    ref = _layers.get(name)
    other = ref() if ref is not None else None
    if other is not None and other is not layer:
        raise ValueError(
            f"attention layer name {name!r} is already used by another live layer; give the second "
            "model a distinct prefix (models pick a unique one when prefix=None)"
        )
    _layers[name] = weakref.ref(layer)


def unregister(layer: Attention) -> None:
    """Forget ``layer`` (e.g. when a model replaces its caches); a no-op if it is not registered."""
    ref = _layers.get(layer.spec.name)
    if ref is not None and ref() is layer:
        del _layers[layer.spec.name]


def lookup(name: str) -> LayerKVSpec:
    """The spec of the live layer called ``name``; KeyError naming it if there is none."""
    ref = _layers.get(name)
    layer = ref() if ref is not None else None
    if layer is None:
        known = sorted(n for n, r in _layers.items() if r() is not None)
        raise KeyError(
            f"unknown attention layer {name!r}; live layers: {known[:6]}{'...' if len(known) > 6 else ''}"
        )
    return layer.spec


def is_live(name: str) -> bool:
    ref = _layers.get(name)
    return ref is not None and ref() is not None


def unique_prefix(base: str) -> str:
    """``base`` if no live layer starts with ``base + '.'``, else ``base_1``, ``base_2``, ..."""
    taken = {n.split(".", 1)[0] for n, r in _layers.items() if r() is not None}
    if base not in taken:
        return base
    i = 1
    while f"{base}_{i}" in taken:
        i += 1
    return f"{base}_{i}"
