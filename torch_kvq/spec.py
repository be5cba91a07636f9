"""Per-layer KV-cache quantization spec: the config a user writes, and the resolved spec.

``KVCacheConfig`` is what a user writes (its modes: ``spec_modes.KVQuantMode``);
``spec_resolve.resolve_layer_specs`` turns it, plus the model's attention layers
(``AttentionLayerInfo``), into one frozen ``LayerKVSpec`` per layer. Every later decision (cache
dtype, fusion, kernel, query dtype, output dtype) reads the layer's own spec; nothing reads a
global cache dtype. ``spec_table`` prints the specs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from torch_kvq.spec_channels import KBasis, KChannelScale
from torch_kvq.spec_modes import SCALE_BYTES, KVQuantMode, parse_kv_cache_dtype, tc4_aux_width

SUPPORTED_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# the model (activation / query) dtypes a layer may have; kernels may serve fewer (capabilities.py)
MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SKIP_RULE_FORMS = (
    "an int layer index (negative counts from the end)",
    "'sliding_window' (every layer with a sliding window)",
    "'full_attention' (every layer without one)",
    "a layer-name glob containing '*', '?' or '[' (e.g. 'model.layers.1*')",
    "an exact layer name",
)


def is_positive_int(value: object) -> bool:
    """An ``int`` (not a ``bool``) of at least 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_positive_int(value: object, what: str) -> int:
    """``value`` if it is a positive int, else ``ValueError("<what> must be a positive int, ...")``."""
    if not is_positive_int(value):
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value  # type: ignore[return-value]


def check_scale(value: object, what: str) -> float:
    """Return ``value`` as a float if it is a finite positive number, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a positive finite float, got {value!r}")
    f = float(value)
    if not math.isfinite(f) or f <= 0.0:
        raise ValueError(f"{what} must be a positive finite float, got {value!r}")
    return f


@dataclass(frozen=True)
class KVCacheConfig:
    """What the user asks for. Frozen and hashable.

    Args:
        kv_cache_dtype: the mode of every layer no rule selects: ``auto`` | ``bfloat16`` |
            ``float16`` | ``float32`` | ``fp8`` | ``fp8_e4m3`` | ``int8_per_token_head`` |
            ``fp8_per_token_head`` | ``int4_per_token_head`` | ``k8v4_per_token_head`` (k int8, v
            int4; even head sizes only, as int4) | ``tc4_per_token_head`` (transform-coded; head
            sizes a multiple of 16; needs ``k_bases``).
        layer_modes: ``((rule, kv_cache_dtype string), ...)`` (or a mapping): a per-layer mode
            map. A rule is an int index (negative from the end), ``"sliding_window"``,
            ``"full_attention"``, a name glob, or an exact layer name. Precedence: a layer takes
            the mode of the rules that match it, and ``kv_cache_dtype`` where none does; two
            matching rules that give one layer different modes are a ValueError.
        skip_layers: rules (same forms) for layers kept in the model dtype: each is a
            ``layer_modes`` rule with mode ``"auto"``.
        page_size: tokens per KV page.
        kv_scales: per-layer static ``(k_scale, v_scale)`` of ``fp8`` (per-tensor) layers, keyed
            by layer name or index; layers not listed use ``default_k_scale`` /
            ``default_v_scale``. Scales for a per-(token, head) layer are a ValueError.
        k_channel_scales: per-layer ``KChannelScale`` of ``int4_per_token_head`` layers, keyed by
            layer name or index: k scaled (and centred) per (kv head, channel) before the
            layer's write, q scaled to match (``KChannelScale``). Layers not listed are not
            scaled; an entry for a layer of another mode is a ValueError.
        k_bases: per-layer ``KBasis`` of ``tc4_per_token_head`` layers, keyed by layer name or
            index: every such layer needs one (``kvq eval``'s ``basis=calibrate`` makes them); an
            entry for a layer of another mode is a ValueError.
    """

    kv_cache_dtype: str = "auto"
    skip_layers: tuple[int | str, ...] = ()
    page_size: int = 16
    kv_scales: tuple[tuple[int | str, tuple[float, float]], ...] = ()
    default_k_scale: float = 1.0
    default_v_scale: float = 1.0
    layer_modes: tuple[tuple[int | str, str], ...] = ()
    k_channel_scales: tuple[tuple[int | str, KChannelScale], ...] = ()
    k_bases: tuple[tuple[int | str, KBasis], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.layer_modes, Mapping):
            object.__setattr__(self, "layer_modes", tuple(self.layer_modes.items()))
        else:
            object.__setattr__(self, "layer_modes", tuple(tuple(r) for r in self.layer_modes))
        for item in self.layer_modes:
            if len(item) != 2:
                raise ValueError(
                    f"layer_modes entry {item!r} must be a (rule, kv_cache_dtype string) pair"
                )
            _check_rule_form(item[0])
            parse_kv_cache_dtype(item[1], torch.bfloat16)
        mapped = [rule for rule, _ in self.layer_modes]
        twice = sorted({repr(r) for r in mapped if mapped.count(r) > 1})
        if twice:
            raise ValueError(f"layer_modes lists rule {', '.join(twice)} more than once")
        if isinstance(self.skip_layers, (str, int)):
            object.__setattr__(self, "skip_layers", (self.skip_layers,))
        else:
            object.__setattr__(self, "skip_layers", tuple(self.skip_layers))
        if isinstance(self.kv_scales, Mapping):
            object.__setattr__(self, "kv_scales", tuple(self.kv_scales.items()))
        else:
            object.__setattr__(self, "kv_scales", tuple(tuple(kv) for kv in self.kv_scales))
        parse_kv_cache_dtype(self.kv_cache_dtype, torch.bfloat16)  # validate early
        for rule in self.skip_layers:
            _check_rule_form(rule)
        rules = list(self.skip_layers)
        twice = sorted({repr(r) for r in rules if rules.count(r) > 1})
        if twice:
            raise ValueError(f"skip_layers lists rule {', '.join(twice)} more than once")
        if isinstance(self.page_size, bool) or self.page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(
                f"unsupported page_size {self.page_size!r}; expected one of {SUPPORTED_PAGE_SIZES}"
            )
        check_scale(self.default_k_scale, "default_k_scale")
        check_scale(self.default_v_scale, "default_v_scale")
        scaled = [key for key, _ in self.kv_scales]
        dupes = sorted({repr(k) for k in scaled if scaled.count(k) > 1})
        if dupes:
            raise ValueError(f"kv_scales lists layer(s) {', '.join(dupes)} more than once")
        for key, pair in self.kv_scales:
            if not isinstance(key, (int, str)) or isinstance(key, bool):
                raise ValueError(f"kv_scales key {key!r} must be a layer index or layer name")
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ValueError(
                    f"kv_scales[{key!r}] must be a (k_scale, v_scale) pair, got {pair!r}"
                )
            check_scale(pair[0], f"k_scale of layer {key!r}")
            check_scale(pair[1], f"v_scale of layer {key!r}")
        self._check_layer_table("k_channel_scales", KChannelScale)
        self._check_layer_table("k_bases", KBasis)

    def _check_layer_table(self, field: str, kind: type) -> None:
        """``field`` as a tuple of (layer index or name, ``kind``) pairs, each layer once."""
        table = getattr(self, field)
        table = tuple(table.items()) if isinstance(table, Mapping) else tuple(map(tuple, table))
        object.__setattr__(self, field, table)
        keys = [item[0] for item in table]
        dupes = sorted({repr(k) for k in keys if keys.count(k) > 1})
        if dupes:
            raise ValueError(f"{field} lists layer(s) {', '.join(dupes)} more than once")
        for item in table:
            if len(item) != 2 or isinstance(item[0], bool) or not isinstance(item[0], (int, str)):
                raise ValueError(
                    f"{field} entry {item!r:.80} must be a (layer index or name, "
                    f"{kind.__name__}) pair"
                )
            if not isinstance(item[1], kind):
                raise ValueError(
                    f"{field}[{item[0]!r}] must be a {kind.__name__}, got {type(item[1]).__name__}"
                )

    @property
    def mode_rules(self) -> tuple[tuple[int | str, str, str], ...]:
        """Every rule as (rule, kv_cache_dtype string, where it came from): ``layer_modes``
        first, then ``skip_layers`` (mode ``"auto"``)."""
        return tuple((r, m, "layer_modes") for r, m in self.layer_modes) + tuple(
            (r, "auto", "skip_layers") for r in self.skip_layers
        )

    @property
    def rules(self) -> tuple[int | str, ...]:
        """Every layer rule (``layer_modes`` and ``skip_layers``), for ``skip_rule_notes``."""
        return tuple(r for r, _, _ in self.mode_rules)


def _check_rule_form(rule: object) -> None:
    if isinstance(rule, bool) or not isinstance(rule, (int, str)):
        raise ValueError(
            f"unknown skip rule {rule!r}; accepted forms: {'; '.join(SKIP_RULE_FORMS)}"
        )
    if isinstance(rule, str) and not rule.strip():
        raise ValueError(f"empty skip rule {rule!r}; accepted forms: {'; '.join(SKIP_RULE_FORMS)}")


@dataclass(frozen=True)
class AttentionLayerInfo:
    """What a model declares about one attention layer (no quantization choices here)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    sliding_window: int | None = None  # attend to keys with q_pos - k_pos < sliding_window
    logits_soft_cap: float | None = None
    sm_scale: float | None = None  # None -> head_size ** -0.5


@dataclass(frozen=True)
class LayerKVSpec:
    """The resolved, frozen per-layer KV spec. The only thing later code reads per layer.

    ``sm_scale``, the softmax scale, left out (``None``) means ``1 / sqrt(head_size)``; it is
    resolved on construction, so the stored value is always the scale attention uses. A scale
    that is not a positive finite float is a ``ValueError`` (never a silent uniform attention).
    """

    name: str
    index: int
    mode: KVQuantMode
    storage_dtype: torch.dtype  # the cache dtype
    model_dtype: torch.dtype  # q / k / v / output dtype of the layer
    num_heads: int
    num_kv_heads: int
    head_size: int
    page_size: int
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sm_scale: float | None = None  # None -> head_size ** -0.5; a float once constructed
    k_scale: float = 1.0
    v_scale: float = 1.0
    skip_reason: str | None = None  # which skip rule kept this layer unquantized
    uncalibrated: bool = False  # a quantized layer on the default scales 1.0: nobody chose them
    k_channel: KChannelScale | None = None  # int4 layers: k scaled per (kv head, channel)
    k_basis: KBasis | None = None  # tc4 layers: k through P, q through P^-T

    def __post_init__(self) -> None:
        if self.sm_scale is None:
            hs = self.head_size
            if isinstance(hs, bool) or not isinstance(hs, int) or hs <= 0:
                raise ValueError(
                    f"layer {self.name!r}: the default sm_scale is 1 / sqrt(head_size), and "
                    f"head_size must be a positive int, got {hs!r}"
                )
            object.__setattr__(self, "sm_scale", hs**-0.5)
        else:
            scale = check_scale(self.sm_scale, f"layer {self.name!r}: sm_scale")
            object.__setattr__(self, "sm_scale", scale)

    @property
    def is_quantized(self) -> bool:
        return self.mode.is_quantized

    @property
    def attention_type(self) -> str:
        return "sliding" if self.sliding_window is not None else "global"

    @property
    def scale_bytes_per_token(self) -> int:
        """K plus V scale bytes one token takes (``kv_scale``): per-(token, head) modes (and
        ``TC4_PER_TOKEN_HEAD``'s side row, ``tc4_aux_width``) only."""
        if self.mode.transform_coded:
            return self.num_kv_heads * tc4_aux_width(self.head_size)
        return 2 * self.num_kv_heads * SCALE_BYTES if self.mode.per_token_head else 0

    @property
    def code_dim(self) -> int:
        """The cache's last dim: ``head_size``, or ``head_size // 2`` for ``int4_per_token_head``
        (two codes per byte) and ``k8v4_per_token_head`` (k's D int8 codes in two slots)."""
        return self.head_size // self.mode.codes_per_byte

    @property
    def cache_bytes_per_token(self) -> int:
        """K plus V bytes one token takes in this layer's cache: codes plus scales (per kv head
        ``k8v4_per_token_head``: D + D / 2 + 8)."""
        codes = (
            self.mode.cache_slots * self.num_kv_heads * self.code_dim * self.storage_dtype.itemsize
        )
        return codes + self.scale_bytes_per_token

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, KVQuantMode):
                v = v.value
            elif isinstance(v, torch.dtype):
                v = str(v)
            elif isinstance(v, (KChannelScale, KBasis)):
                v = v.label  # a digest, not [KH][D] numbers
            out[f.name] = v
        return out
