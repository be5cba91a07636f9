"""Per-layer KV-cache quantization spec: the modes, the config a user writes, and the resolved spec.

``KVCacheConfig`` is what a user writes; ``spec_resolve.resolve_layer_specs`` turns it, plus the
model's attention layers (``AttentionLayerInfo``), into one frozen ``LayerKVSpec`` per layer. Every
later decision (cache dtype, fusion, kernel, query dtype, output dtype) reads the layer's own spec;
nothing reads a global cache dtype. ``spec_table`` prints the specs.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

from torch_kvq.spec_channels import KBasis, KChannelScale

FP8_DTYPE = torch.float8_e4m3fn  # what the FP8 modes store; their math: attention/quant.py
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


class KVQuantMode(enum.Enum):
    """How a layer's KV cache is stored. Values are strings and are never persisted as ints."""

    NONE = "none"  # cache in the model dtype (bf16 / fp16 / fp32)
    FP8_PER_TENSOR = "fp8_per_tensor"  # float8_e4m3fn, static per-tensor k and v scales
    INT8_PER_TOKEN_HEAD = "int8_per_token_head"  # int8, one fp32 scale per (token, kv head)
    FP8_PER_TOKEN_HEAD = "fp8_per_token_head"  # float8_e4m3fn, one fp32 scale per (token, kv head)
    # two rotated, asymmetric 4-bit codes per uint8 byte, one fp32 scale per (token, kv head) with
    # the zero point in its low mantissa bits (attention/quant.py); head size must be even
    INT4_PER_TOKEN_HEAD = "int4_per_token_head"
    # k as INT8_PER_TOKEN_HEAD, v as INT4_PER_TOKEN_HEAD in one uint8 cache [pages, 3, page, KH,
    # D / 2] (slots 0 / 1: k's int8 codes, channels 0..D/2-1 / D/2..D-1; slot 2: v's packed int4);
    # head size must be even
    K8V4_PER_TOKEN_HEAD = "k8v4_per_token_head"
    # transform-coded: k in a calibrated basis per (layer, kv head) at 6 / 4 / 3 bits by the
    # coordinates' weight, v's channel halves rotated at 5 / 4 bits, an fp16 scale and a zero-point
    # byte per group (attention/quant_tc.py); codes uint8 [pages, 2, page, KH, D / 2], the groups'
    # scales and v's fifth bits in ``kv_scale`` uint8 [pages, KH, tc4_aux_width(D), page]; needs
    # the layer's ``KBasis``; head size a multiple of 16
    TC4_PER_TOKEN_HEAD = "tc4_per_token_head"

    @property
    def is_quantized(self) -> bool:
        return self is not KVQuantMode.NONE

    @property
    def per_token_head(self) -> bool:
        """Scales computed per (token, kv head) when the token is written (``kv_scale``)."""
        return self in (
            KVQuantMode.INT8_PER_TOKEN_HEAD,
            KVQuantMode.FP8_PER_TOKEN_HEAD,
            KVQuantMode.INT4_PER_TOKEN_HEAD,
            KVQuantMode.K8V4_PER_TOKEN_HEAD,
        )

    @property
    def transform_coded(self) -> bool:
        """``TC4_PER_TOKEN_HEAD``: codes and group scales of its own layout (not ``per_token_head``'s
        fp32 ``kv_scale``), k through the layer's calibrated ``KBasis``."""
        return self is KVQuantMode.TC4_PER_TOKEN_HEAD

    @property
    def codes_per_byte(self) -> int:
        """2 for the modes with 4-bit codes (``INT4_PER_TOKEN_HEAD``; ``K8V4_PER_TOKEN_HEAD``'s v;
        ``TC4_PER_TOKEN_HEAD``, D / 2 bytes a row for k and for v), 1 for every other mode; a
        cache's last dim is ``head_size // codes_per_byte``."""
        return 2 if self in _HALF_WIDTH else 1

    @property
    def cache_slots(self) -> int:
        """The cache's dim 1: 2 (k, v) for every mode but ``K8V4_PER_TOKEN_HEAD``, 3 (k's int8
        codes in two halves of ``head_size // 2`` bytes, v's packed int4 codes)."""
        return 3 if self is KVQuantMode.K8V4_PER_TOKEN_HEAD else 2

    @property
    def code_dtype(self) -> torch.dtype | None:
        """What a quantized mode stores (its cache dtype); None for ``NONE`` (the model dtype)."""
        return _CODE_DTYPES.get(self)

    @property
    def qmax(self) -> float | None:
        """The largest code magnitude a scale maps absmax to (127 / 448); None for ``NONE`` and
        ``K8V4_PER_TOKEN_HEAD`` (k's and v's differ: ``k_format`` / ``v_format``)."""
        return _QMAX.get(self)

    @property
    def per_token_head_format(self) -> str:
        """``"int8"`` / ``"fp8"`` / ``"int4"`` / ``"k8v4"``: the ``mode`` argument of the
        per-(token, head) math and ops (``attention/quant.py``; ``"k8v4"`` is the layer's: its k
        and v are quantized to ``k_format`` / ``v_format``); ValueError for a mode that is not
        per-(token, head)."""
        if not self.per_token_head:
            raise ValueError(f"mode {self.value!r} has no per-(token, head) format")
        return self.value.split("_", 1)[0]

    @property
    def k_format(self) -> str:
        """The per-(token, head) format k is quantized to: ``per_token_head_format``, or ``"int8"``
        for ``K8V4_PER_TOKEN_HEAD``; ValueError for a mode that is not per-(token, head)."""
        pair = _KV_FORMATS.get(self)
        return pair[0] if pair else self.per_token_head_format

    @property
    def v_format(self) -> str:
        """The per-(token, head) format v is quantized to: ``per_token_head_format``, or ``"int4"``
        for ``K8V4_PER_TOKEN_HEAD``; ValueError for a mode that is not per-(token, head)."""
        pair = _KV_FORMATS.get(self)
        return pair[1] if pair else self.per_token_head_format


_HALF_WIDTH = (
    KVQuantMode.INT4_PER_TOKEN_HEAD,
    KVQuantMode.K8V4_PER_TOKEN_HEAD,
    KVQuantMode.TC4_PER_TOKEN_HEAD,
)
_CODE_DTYPES = {
    KVQuantMode.FP8_PER_TENSOR: FP8_DTYPE,
    KVQuantMode.INT8_PER_TOKEN_HEAD: torch.int8,
    KVQuantMode.FP8_PER_TOKEN_HEAD: FP8_DTYPE,
    KVQuantMode.INT4_PER_TOKEN_HEAD: torch.uint8,
    KVQuantMode.K8V4_PER_TOKEN_HEAD: torch.uint8,  # k's int8 codes stored as their bit patterns
    KVQuantMode.TC4_PER_TOKEN_HEAD: torch.uint8,
}
# modes whose k and v have different formats (attention/quant.py's KV_FORMATS agrees; a test)
_KV_FORMATS = {KVQuantMode.K8V4_PER_TOKEN_HEAD: ("int8", "int4")}
_QMAX = {  # attention/quant.py's FP8_MAX / INT8_MAX (spec sits below it; a test checks they agree)
    KVQuantMode.FP8_PER_TENSOR: 448.0,
    KVQuantMode.INT8_PER_TOKEN_HEAD: 127.0,
    KVQuantMode.FP8_PER_TOKEN_HEAD: 448.0,
    KVQuantMode.INT4_PER_TOKEN_HEAD: 15.0,  # asymmetric: the codes 0..15 span [lo, hi]
}
SCALE_BYTES = 4  # one fp32 scale per (token, kv head), for k and for v, in per-(token, head) modes
TC4_HEAD_MULTIPLE = 16  # tc4's bit planes pack D / 16 bytes of one-bit codes


def tc4_aux_width(head_size: int) -> int:
    """Bytes of ``TC4_PER_TOKEN_HEAD``'s side record per (token, kv head): k's three fp16 group
    scales and zero points (9), v's two (6), one byte of padding (8 whole fp16 slots), v's first
    half's fifth bits (D / 16); the layout is ``attention/quant_tc.py``'s."""
    return 16 + head_size // TC4_HEAD_MULTIPLE


_DTYPE_ALIASES: dict[str, tuple[KVQuantMode, torch.dtype | None]] = {
    "auto": (KVQuantMode.NONE, None),
    "bfloat16": (KVQuantMode.NONE, torch.bfloat16),
    "bf16": (KVQuantMode.NONE, torch.bfloat16),
    "float16": (KVQuantMode.NONE, torch.float16),
    "fp16": (KVQuantMode.NONE, torch.float16),
    "half": (KVQuantMode.NONE, torch.float16),
    "float32": (KVQuantMode.NONE, torch.float32),
    "fp32": (KVQuantMode.NONE, torch.float32),
    "fp8": (KVQuantMode.FP8_PER_TENSOR, FP8_DTYPE),
    "fp8_e4m3": (KVQuantMode.FP8_PER_TENSOR, FP8_DTYPE),
    "int8_per_token_head": (KVQuantMode.INT8_PER_TOKEN_HEAD, torch.int8),
    "fp8_per_token_head": (KVQuantMode.FP8_PER_TOKEN_HEAD, FP8_DTYPE),
    "int4_per_token_head": (KVQuantMode.INT4_PER_TOKEN_HEAD, torch.uint8),
    "k8v4_per_token_head": (KVQuantMode.K8V4_PER_TOKEN_HEAD, torch.uint8),
    "tc4_per_token_head": (KVQuantMode.TC4_PER_TOKEN_HEAD, torch.uint8),
}


def parse_kv_cache_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype
) -> tuple[KVQuantMode, torch.dtype]:
    """Map a ``kv_cache_dtype`` string to (mode, storage dtype). ``auto`` means the model dtype."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype.lower() not in _DTYPE_ALIASES:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected one of {sorted(_DTYPE_ALIASES)}"
        )
    mode, dtype = _DTYPE_ALIASES[kv_cache_dtype.lower()]
    return mode, (dtype if dtype is not None else model_dtype)


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
