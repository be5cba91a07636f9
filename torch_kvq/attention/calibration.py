"""Static k/v scale calibration: amax over a sample, divided by the FP8 maximum (448).

An amax that is zero, negative, NaN or infinite has no scale: it is an error naming the layer and
whether k or v (a layer whose k is all zeros, or that overflowed, is never given a silent 1.0).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from torch_kvq.attention.layer import Attention
from torch_kvq.attention.quant import FP8_MAX


def amax_to_scale(amax: float, eps: float = 1e-12) -> float:
    """Scale that maps ``amax`` to the FP8 maximum (at least ``eps``).

    Raises ValueError naming the value if ``amax`` is not a positive finite number.
    """
    a = float(amax)
    if not (math.isfinite(a) and a > 0.0):
        raise ValueError(f"amax must be a positive finite number to give an FP8 scale, got {a!r}")
    return max(a / FP8_MAX, eps)


def layer_kv_scales(layer: str, k_amax: float, v_amax: float) -> tuple[float, float]:
    """(k_scale, v_scale) of ``layer`` from its k / v amax; a bad amax is a ValueError naming the
    layer and whether it is k's or v's."""
    scales = []
    for which, amax in (("k", float(k_amax)), ("v", float(v_amax))):
        try:
            scales.append(amax_to_scale(amax))
        except ValueError as e:
            seen = (
                f" ({which} was all zeros in the calibration sample)"
                if amax == 0.0
                else f" ({which} held NaN or inf in the calibration sample)"
                if not math.isfinite(amax)
                else ""
            )
            raise ValueError(
                f"layer {layer!r}: {which} amax {amax!r} gives no FP8 scale{seen}; "
                "a scale needs a positive finite amax"
            ) from e
    return scales[0], scales[1]


def _max_or_nan(a: float, b: float) -> float:
    """max(a, b), but NaN if either is NaN (Python's max drops a NaN in second place)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


@torch.no_grad()
def calibrate_kv_scales(
    model: nn.Module, run: Callable[[], object]
) -> dict[str, tuple[float, float]]:
    """Run ``run()`` (eager forward passes of ``model``) and return per-layer (k_scale, v_scale).

    Records the absolute maximum of k and v entering every ``Attention`` layer. Feed the result to
    ``KVCacheConfig(kv_scales=...)``. A layer whose k or v amax is zero (all zeros in the sample),
    NaN or infinite is a ValueError naming the layer and k or v. A tensor-parallel model
    (``model.tp``, every rank calling this alike): each rank sees its own heads, so the amax is
    taken over all ranks and every rank gets the same scales.
    """
    amax: dict[str, list[float]] = {}
    hooks = []

    def hook(mod: Attention, args: tuple[torch.Tensor, ...]) -> None:
        _, k, v = args[:3]
        cur = amax.setdefault(mod.layer_name, [0.0, 0.0])
        cur[0] = _max_or_nan(cur[0], float(k.abs().max()))
        cur[1] = _max_or_nan(cur[1], float(v.abs().max()))

    for mod in model.modules():
        if isinstance(mod, Attention):
            hooks.append(mod.register_forward_pre_hook(hook))
    if not hooks:
        raise ValueError(f"{type(model).__name__} has no torch_kvq Attention layers to calibrate")
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    tp = getattr(model, "tp", None)
    if tp is not None and tp.size > 1:
        from torch_kvq.distributed import gather

        for other in gather(tp, amax):
            for name, (k, v) in other.items():
                cur = amax.setdefault(name, [0.0, 0.0])
                cur[0], cur[1] = _max_or_nan(cur[0], k), _max_or_nan(cur[1], v)
    return {name: layer_kv_scales(name, k, v) for name, (k, v) in amax.items()}
