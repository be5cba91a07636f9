"""K channel scales of 4-bit layers as the spec holds them: ``KChannelScale``, frozen float rows.

Apart from ``spec`` so that the data types stay small; ``spec.KVCacheConfig.k_channel_scales`` and
``spec.LayerKVSpec.k_channel`` hold them, ``attention/k_channels.py`` has their math.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Rows = tuple[tuple[float, ...], ...]


def _rows(value: object, what: str, positive: bool) -> Rows:
    """``value`` ([KH][D] nested sequences or a 2-D tensor) as a rectangular tuple of float rows,
    every value finite (and positive with ``positive``); ValueError naming ``what`` otherwise."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 2:
            raise ValueError(
                f"{what} must be 2-D [num_kv_heads, head_size], got {tuple(value.shape)}"
            )
        value = value.detach().double().cpu().tolist()
    if (
        not isinstance(value, Sequence)
        or not value
        or not all(isinstance(r, Sequence) and not isinstance(r, str) and len(r) for r in value)
    ):
        raise ValueError(f"{what} must be [num_kv_heads][head_size] numbers, got {value!r:.80}")
    rows = tuple(tuple(float(x) for x in r) for r in value)
    if len({len(r) for r in rows}) != 1:
        raise ValueError(f"{what} rows differ in length: {[len(r) for r in rows]}")
    bad = [x for r in rows for x in r if not math.isfinite(x) or (positive and x <= 0.0)]
    if bad:
        need = "positive finite" if positive else "finite"
        raise ValueError(f"{what} must be {need} everywhere, got {bad[0]!r}")
    return rows


@dataclass(frozen=True)
class KChannelScale:
    """K scaled per (kv head, channel) in a 4-bit layer: the cache holds the codes of
    ``(k - mean) / scale`` and attention reads ``q * scale`` (its kv head's row), so every score
    is unchanged in exact arithmetic (the mean shifts a query's scores by one constant, which the
    softmax ignores), while each channel's range in the 4-bit codes is balanced against how much
    q weighs it. ``scale`` [num_kv_heads][head_size], positive; ``mean`` the same shape, or None
    (not centred). Tensors are accepted and stored as float tuples (the spec stays frozen and
    hashable); ``kvq calibrate`` makes them (``attention/k_channels.py``: the math)."""

    scale: Rows
    mean: Rows | None = None

    def __post_init__(self) -> None:
        scale = _rows(self.scale, "k channel scale", positive=True)
        object.__setattr__(self, "scale", scale)
        if self.mean is not None:
            mean = _rows(self.mean, "k channel mean", positive=False)
            if (len(mean), len(mean[0])) != (len(scale), len(scale[0])):
                raise ValueError(
                    f"k channel mean is {len(mean)} x {len(mean[0])}, its scale "
                    f"{len(scale)} x {len(scale[0])}; expected one shape"
                )
            object.__setattr__(self, "mean", mean)

    @property
    def shape(self) -> tuple[int, int]:
        """(num_kv_heads, head_size)."""
        return len(self.scale), len(self.scale[0])

    @property
    def kind(self) -> str:
        """``scaled``, or ``scaled+centred`` with a mean."""
        return "scaled" if self.mean is None else "scaled+centred"

    @functools.cached_property
    def label(self) -> str:
        """``kind`` with a digest of the values (tables, cache keys), hashed once."""
        digest = hashlib.sha1(repr((self.scale, self.mean)).encode()).hexdigest()[:8]
        return f"{self.kind} {digest}"

    def heads(self, part: slice) -> KChannelScale:
        """The rows of kv heads ``part`` (a tensor-parallel rank's)."""
        return KChannelScale(self.scale[part], None if self.mean is None else self.mean[part])


@dataclass(frozen=True)
class KBasis:
    """The calibrated K basis of a ``tc4_per_token_head`` layer: P [num_kv_heads, D, D]. The
    cache holds the codes of ``P k`` (its first coordinates those that weigh most in the scores,
    which the mode spends the most bits on) and attention reads ``P^-T q``, so every score is
    unchanged in exact arithmetic. Held as the float32 bytes of P (the spec stays frozen and
    hashable, and a large model's bases stay compact); ``KBasis.of`` takes a tensor, ``matrix``
    gives one back. ``kvq eval``'s ``basis=calibrate`` makes them (``attention/k_basis.py``)."""

    data: bytes
    shape: tuple[int, int, int]

    def __post_init__(self) -> None:
        kh, d, d2 = self.shape
        if d != d2 or kh < 1 or d < 1:
            raise ValueError(f"a K basis is [num_kv_heads, D, D], got shape {self.shape}")
        if len(self.data) != 4 * kh * d * d:
            raise ValueError(
                f"K basis data has {len(self.data)} bytes; {self.shape} needs {4 * kh * d * d}"
            )
        if not torch.isfinite(self.matrix()).all():
            raise ValueError("K basis values must be finite everywhere")

    @classmethod
    def of(cls, p: torch.Tensor) -> KBasis:
        """From P [num_kv_heads, D, D] (any float dtype, any device)."""
        if not isinstance(p, torch.Tensor) or p.dim() != 3 or p.shape[1] != p.shape[2]:
            got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"a K basis is a [num_kv_heads, D, D] tensor, got {got}")
        f = p.detach().float().cpu().contiguous()
        return cls(f.numpy().tobytes(), tuple(f.shape))  # type: ignore[arg-type]

    def matrix(self) -> torch.Tensor:
        """P [num_kv_heads, D, D] float32 (a new CPU tensor)."""
        return torch.frombuffer(bytearray(self.data), dtype=torch.float32).reshape(self.shape)

    @functools.cached_property
    def label(self) -> str:
        """``basis`` with a digest of the values (tables, cache keys), hashed once."""
        return f"basis {hashlib.sha1(self.data).hexdigest()[:8]}"

    def heads(self, part: slice) -> KBasis:
        """The bases of kv heads ``part`` (a tensor-parallel rank's)."""
        return KBasis.of(self.matrix()[part])
