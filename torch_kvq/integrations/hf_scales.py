"""Per-layer FP8 KV scales from a checkpoint, in the layouts FP8-KV exporters write.

Scalar tensors under each attention module (``P`` = its HF path, e.g. ``model.layers.0.self_attn``):

- ``P.k_scale`` / ``P.v_scale``: compressed-tensors (llm-compressor) and recent ModelOpt exports;
- ``P.k_proj.k_scale`` / ``P.v_proj.v_scale``: ModelOpt;
- ``P.k_proj.output_scale`` / ``P.v_proj.output_scale``: older compressed-tensors exports;
- ``P.attn.k_scale`` / ``P.attn.v_scale`` and ``P.qkv_proj.k_scale`` / ``...v_scale``: vLLM-style;
- ``P.kv_scale`` (or ``P.attn.kv_scale``): one scale for both (older FP8 checkpoints).

A scale is the dequantization factor (``real = fp8 * scale``), the convention of
``LayerKVSpec.k_scale``. Only per-tensor scales (one element) are accepted.

K channel scales of 4-bit layers (``spec_channels.KChannelScale``), which ``kvq calibrate``
writes beside them: ``P.k_channel_scale`` [KH, D] and, when k is centred, ``P.k_channel_mean``
[KH, D] (``checkpoint_k_channel_scales``); the K bases of tc4 layers (``spec_channels.KBasis``):
``P.k_basis`` [KH, D, D] (``checkpoint_k_bases``). ``layer_table`` picks a table's entries for
the layers of its mode, every one of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from torch_kvq.spec_channels import KBasis, KChannelScale

ScaleSource = str | Path | Mapping[str, torch.Tensor]
K_KEYS = ("k_scale", "k_proj.k_scale", "k_proj.output_scale", "attn.k_scale", "qkv_proj.k_scale")
V_KEYS = ("v_scale", "v_proj.v_scale", "v_proj.output_scale", "attn.v_scale", "qkv_proj.v_scale")
BOTH_KEYS = ("kv_scale", "attn.kv_scale")


def _read(source: ScaleSource, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of ``wanted`` keys that ``source`` holds (files are read key by key)."""
    if isinstance(source, Mapping):
        return {k: v for k, v in source.items() if k in wanted}
    path = Path(source)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"no safetensors checkpoint at {str(path)!r}")
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in set(fh.keys()) & wanted:
                found[key] = fh.get_tensor(key)
    return found


def _scalar(key: str, t: torch.Tensor) -> float:
    if t.numel() != 1:
        raise ValueError(
            f"checkpoint scale {key!r} has shape {tuple(t.shape)}; only per-tensor (one-element) "
            "KV scales are supported"
        )
    return float(t.float().reshape(()))


def _pick(path: str, keys: Sequence[str], found: Mapping[str, torch.Tensor]) -> float | None:
    present = [f"{path}.{k}" for k in keys if f"{path}.{k}" in found]
    vals = {key: _scalar(key, found[key]) for key in present}
    if len(set(vals.values())) > 1:
        raise ValueError(f"layer {path!r}: the checkpoint gives different scales {vals}")
    return next(iter(vals.values()), None)


def checkpoint_kv_scales(
    source: ScaleSource, paths: Sequence[str]
) -> dict[str, tuple[float, float]]:
    """HF attention path -> (k_scale, v_scale) for every path in ``paths`` the checkpoint covers.

    ValueError if it covers none, gives a layer only one of k / v, or holds non-scalar scales.
    """
    wanted = {f"{p}.{k}" for p in paths for k in (*K_KEYS, *V_KEYS, *BOTH_KEYS)}
    found = _read(source, wanted)
    out: dict[str, tuple[float, float]] = {}
    for p in paths:
        both = _pick(p, BOTH_KEYS, found)
        k, v = (_pick(p, keys, found) for keys in (K_KEYS, V_KEYS))
        k, v = (k if k is not None else both), (v if v is not None else both)
        if k is None and v is None:
            continue
        if k is None or v is None:
            raise ValueError(
                f"layer {p!r}: the checkpoint has a {'v' if k is None else 'k'} scale only"
            )
        out[p] = (k, v)
    if not out:
        raise ValueError(
            f"no KV scales in the checkpoint for any attention layer; looked for keys like "
            f"{paths[0]}.k_scale / {paths[0]}.k_proj.output_scale / {paths[0]}.kv_scale"
        )
    return out


def checkpoint_k_channel_scales(
    source: ScaleSource, paths: Sequence[str]
) -> dict[str, KChannelScale]:
    """HF attention path -> ``KChannelScale`` for every path in ``paths`` with a
    ``P.k_channel_scale`` (its ``P.k_channel_mean`` when present). ValueError if the checkpoint
    has none, a mean without its scale, or values a ``KChannelScale`` refuses (named by key)."""
    wanted = {f"{p}.k_channel_{w}" for p in paths for w in ("scale", "mean")}
    found = _read(source, wanted)
    out: dict[str, KChannelScale] = {}
    for p in paths:
        scale, mean = found.get(f"{p}.k_channel_scale"), found.get(f"{p}.k_channel_mean")
        if scale is None and mean is not None:
            raise ValueError(
                f"layer {p!r}: the checkpoint has a k_channel_mean but no k_channel_scale"
            )
        if scale is None:
            continue
        try:
            out[p] = KChannelScale(scale, mean)
        except ValueError as e:
            raise ValueError(f"checkpoint {p}.k_channel_scale / k_channel_mean: {e}") from None
    if not out:
        raise ValueError(
            f"no K channel scales in the checkpoint for any attention layer; looked for keys like "
            f"{paths[0]}.k_channel_scale (kvq calibrate writes them)"
        )
    return out


def checkpoint_k_bases(source: ScaleSource, paths: Sequence[str]) -> dict[str, KBasis]:
    """HF attention path -> ``KBasis`` for every path in ``paths`` with a ``P.k_basis`` [KH, D, D]
    (``tc4_per_token_head``'s, what ``kvq calibrate`` writes). ValueError if the checkpoint has
    none, or values a ``KBasis`` refuses (named by key)."""
    found = _read(source, {f"{p}.k_basis" for p in paths})
    out: dict[str, KBasis] = {}
    for p in paths:
        if f"{p}.k_basis" in found:
            try:
                out[p] = KBasis.of(found[f"{p}.k_basis"])
            except ValueError as e:
                raise ValueError(f"checkpoint {p}.k_basis: {e}") from None
    if not out:
        raise ValueError(
            f"no K bases in the checkpoint for any attention layer; looked for keys like "
            f"{paths[0]}.k_basis (kvq calibrate writes them)"
        )
    return out


def layer_table(
    table: Mapping[str, Any], paths: set[str], what: str, mode: str, how: str
) -> tuple[tuple[str, Any], ...]:
    """The entries of ``table`` (HF path -> value) for the layers of ``mode`` (HF paths
    ``paths``), every one of them; ValueError when there is no such layer or one is missed."""
    if not paths:
        raise ValueError(
            f"{what} were given, but no layer of this KV config is {mode} (the only mode they "
            "apply to)"
        )
    missing = sorted(paths - set(table))
    if missing:
        raise ValueError(
            f"the {what} miss {len(missing)} of the {len(paths)} {mode} layers, e.g. "
            f"{missing[0]!r}; calibrate them for this model ({how})"
        )
    return tuple((p, c) for p, c in table.items() if p in paths)
