"""Static per-tensor k/v scales calibrated on text, written in the compressed-tensors layout.

``kv_stats(lm, windows)`` runs the model (model-dtype cache) over calibration windows (the corpus's
``calibration`` split, disjoint from the eval split) and records, per layer, the absolute maximum
of k and of v entering attention and chosen percentiles of |k| and |v|. ``scales_from_stats``
turns them into scales::

    scale = statistic * headroom / 448        (statistic: amax, or a percentile of |x|)
    scale = 2 ** ceil(log2(scale))            (with pow2: the next power of two up)

A power-of-two scale divides exactly, so ``x / scale`` lands on the same relative e4m3 grid as
scale 1.0 does; only the range moves (fewer subnormals below, room above). ``DEFAULT_METHOD``
(amax x 2, then the next power of two up) is the method measured no worse than scale 1.0 on the
shipped models: the headroom keeps text the sample did not see from clipping (see
docs/accuracy.md).
``write_scales`` writes ``P.k_scale`` / ``P.v_scale`` float32 scalars (``P`` the HF attention path),
which ``KVQCausalLM.from_hf(..., kv_scales_from=PATH)`` and ``kvq eval --kv fp8:scales=PATH`` read.

``k_channel_scales(lm, windows)`` calibrates the K channel scales of 4-bit layers
(``spec_channels.KChannelScale``; the math in ``attention/k_channels.py``) on the same kind of sample;
``write_scales(..., k_channels=)`` writes them beside the FP8 scales as ``P.k_channel_scale`` /
``P.k_channel_mean``, which ``from_hf(..., k_channels_from=PATH)`` and ``--kv ...:channels=PATH``
read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torch_kvq.attention.k_basis import BasisStats
from torch_kvq.attention.k_channels import ChannelStats
from torch_kvq.attention.layer import Attention
from torch_kvq.attention.quant import FP8_MAX
from torch_kvq.evaluation.eval import teacher_forced_ppl
from torch_kvq.spec import KVCacheConfig
from torch_kvq.spec_channels import KBasis, KChannelScale


@dataclass(frozen=True)
class Method:
    """How a scale is made from a layer's statistics (module docstring)."""

    statistic: str = "amax"  # "amax" or "pNN.NN" (a percentile of |x|)
    headroom: float = 1.0
    pow2: bool = True

    def __post_init__(self) -> None:
        if self.statistic != "amax":
            _percentile(self.statistic)
        if not (math.isfinite(self.headroom) and self.headroom > 0):
            raise ValueError(f"headroom must be a positive finite number, got {self.headroom!r}")

    def label(self) -> str:
        return f"{self.statistic} x {self.headroom:g}{' pow2' if self.pow2 else ''}"


DEFAULT_METHOD = Method("amax", 2.0, pow2=True)


def _percentile(stat: str) -> float:
    try:
        q = float(stat.removeprefix("p"))
    except ValueError:
        q = -1.0
    if not stat.startswith("p") or not 0 < q < 100:
        raise ValueError(f"statistic {stat!r} unknown; expected 'amax' or 'pNN.N' (0 < NN < 100)")
    return q


@dataclass(frozen=True)
class LayerStats:
    """|k| and |v| statistics of one layer over the calibration sample."""

    k: dict[str, float]  # "amax" and "pNN.NN" -> value
    v: dict[str, float]
    clipped_at_1: tuple[float, float]  # fraction of k / v elements with |x| > 448 (scale 1.0)


def _prefill_with(
    lm: torch.nn.Module,
    windows: Sequence[Sequence[int]],
    hook: Callable[[Attention, tuple[torch.Tensor, ...]], None],
) -> None:
    """Prefill ``windows`` with a model-dtype cache, ``hook`` seeing every ``Attention`` call's
    (q, k, v, ...) as the layer receives them."""
    lm.configure_kv(KVCacheConfig(page_size=lm.kv_config.page_size))
    hooks = [m.register_forward_pre_hook(hook) for m in lm.attention_layers]
    try:
        teacher_forced_ppl(lm, windows)
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def kv_stats(
    lm: torch.nn.Module,
    windows: Sequence[Sequence[int]],
    percentiles: Sequence[str] = ("p99.9", "p99.99"),
) -> dict[str, LayerStats]:
    """HF attention path -> ``LayerStats`` from prefilling ``windows`` with a model-dtype cache."""
    for p in percentiles:
        _percentile(p)
    seen: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def hook(mod: Attention, args: tuple[torch.Tensor, ...]) -> None:
        _, k, v = args[:3]
        ks, vs = seen.setdefault(mod.layer_name, ([], []))
        ks.append(k.detach().abs().float().flatten().cpu())
        vs.append(v.detach().abs().float().flatten().cpu())

    _prefill_with(lm, windows, hook)
    out = {}
    for name, path in lm.layer_paths.items():
        ks, vs = (torch.cat(x) for x in seen[name])
        out[path] = LayerStats(
            k=_summary(ks, percentiles),
            v=_summary(vs, percentiles),
            clipped_at_1=(
                float((ks > FP8_MAX).float().mean()),
                float((vs > FP8_MAX).float().mean()),
            ),
        )
    return out


def _qk_stats(
    lm: torch.nn.Module, windows: Sequence[Sequence[int]], make: Callable[[], Any]
) -> dict:
    """HF attention path -> ``make()``'s statistics (``ChannelStats``, ``BasisStats``) of the
    layer after prefilling ``windows`` with a model-dtype cache, fed q and k as the ``Attention``
    layer gets them (post-RoPE)."""
    seen: dict[str, Any] = {}

    def hook(mod: Attention, args: tuple[torch.Tensor, ...]) -> None:
        seen.setdefault(mod.layer_name, make()).add(args[0], args[1])

    _prefill_with(lm, windows, hook)
    return {path: seen[name] for name, path in lm.layer_paths.items()}


@torch.no_grad()
def k_channel_scales(
    lm: torch.nn.Module, windows: Sequence[Sequence[int]], centred: bool = True
) -> dict[str, KChannelScale]:
    """HF attention path -> the layer's ``KChannelScale`` (``centred``: with k's mean), from
    ``windows`` (``_qk_stats``)."""
    out = {}
    for path, stats in _qk_stats(lm, windows, ChannelStats).items():
        scale, mean = stats.scale_and_mean()
        out[path] = KChannelScale(scale, mean if centred else None)
    return out


@torch.no_grad()
def k_bases(lm: torch.nn.Module, windows: Sequence[Sequence[int]]) -> dict[str, KBasis]:
    """HF attention path -> the layer's ``KBasis`` (``tc4_per_token_head``), from ``windows``
    (``_qk_stats``)."""
    return {path: stats.basis() for path, stats in _qk_stats(lm, windows, BasisStats).items()}


def _summary(x: torch.Tensor, percentiles: Sequence[str]) -> dict[str, float]:
    out = {"amax": float(x.max())}
    srt = torch.sort(x).values
    for p in percentiles:
        idx = min(len(srt) - 1, math.ceil(_percentile(p) / 100 * len(srt)) - 1)
        out[p] = float(srt[max(idx, 0)])
    return out


def scale_of(value: float, method: Method, layer: str, which: str) -> float:
    """One scale from one statistic (ValueError naming the layer when it is not positive)."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"layer {layer!r}: {which} {method.statistic} is {value!r} in the calibration sample; "
            "a scale needs a positive finite statistic"
        )
    s = value * method.headroom / FP8_MAX
    return 2.0 ** math.ceil(math.log2(s)) if method.pow2 else s


def scales_from_stats(
    stats: Mapping[str, LayerStats], method: Method = DEFAULT_METHOD
) -> dict[str, tuple[float, float]]:
    """HF attention path -> (k_scale, v_scale)."""
    return {
        path: (
            scale_of(st.k[method.statistic], method, path, "k"),
            scale_of(st.v[method.statistic], method, path, "v"),
        )
        for path, st in stats.items()
    }


def write_scales(
    scales: Mapping[str, tuple[float, float]],
    path: str | Path,
    metadata: Mapping[str, str],
    k_channels: Mapping[str, KChannelScale] | None = None,
    k_bases: Mapping[str, KBasis] | None = None,
) -> Path:
    """Write ``P.k_scale`` / ``P.v_scale`` float32 scalars (compressed-tensors layout) and, with
    ``k_channels``, ``P.k_channel_scale`` / ``P.k_channel_mean`` [KH, D] float32; with
    ``k_bases``, ``P.k_basis`` [KH, D, D] float32."""
    from safetensors.torch import save_file

    tensors = {}
    for p, (k, v) in scales.items():
        tensors[f"{p}.k_scale"] = torch.tensor(k, dtype=torch.float32)
        tensors[f"{p}.v_scale"] = torch.tensor(v, dtype=torch.float32)
    for p, ch in (k_channels or {}).items():
        tensors[f"{p}.k_channel_scale"] = torch.tensor(ch.scale, dtype=torch.float32)
        if ch.mean is not None:
            tensors[f"{p}.k_channel_mean"] = torch.tensor(ch.mean, dtype=torch.float32)
    for p, basis in (k_bases or {}).items():
        tensors[f"{p}.k_basis"] = basis.matrix().contiguous()
    out = Path(path)
    save_file(tensors, str(out), metadata=dict(metadata))
    return out


__all__ = [
    "DEFAULT_METHOD",
    "LayerStats",
    "Method",
    "k_bases",
    "k_channel_scales",
    "kv_stats",
    "scale_of",
    "scales_from_stats",
    "write_scales",
]
