"""Static k/v scale calibration: amax over a sample, divided by the FP8 maximum (448)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torch_kvq.attention.layer import Attention
from torch_kvq.spec import FP8_MAX


def amax_to_scale(amax: float, eps: float = 1e-12) -> float:
    """Scale that maps ``amax`` to the FP8 maximum; a zero or NaN amax gives 1.0."""
    if not amax > 0.0:  # also catches NaN
        return 1.0
    return max(float(amax) / FP8_MAX, eps)


@torch.no_grad()
def calibrate_kv_scales(
    model: nn.Module, run: Callable[[], object]
) -> dict[str, tuple[float, float]]:
    """Run ``run()`` (eager forward passes of ``model``) and return per-layer (k_scale, v_scale).

    Records the absolute maximum of k and v entering every ``Attention`` layer. Feed the result to
    ``KVCacheConfig(kv_scales=...)``.
    """
    amax: dict[str, list[float]] = {}
    hooks = []

    def hook(mod: Attention, args: tuple[torch.Tensor, ...]) -> None:
        _, k, v = args[:3]
        cur = amax.setdefault(mod.layer_name, [0.0, 0.0])
        cur[0] = max(cur[0], float(k.abs().max()))
        cur[1] = max(cur[1], float(v.abs().max()))

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
    return {name: (amax_to_scale(k), amax_to_scale(v)) for name, (k, v) in amax.items()}
