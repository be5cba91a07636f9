"""Per-layer KV-cache quantization spec: the single place the cache config is read.

``KVCacheConfig`` is what a user writes; ``resolve_layer_specs`` turns it, plus the model's
attention layers (``AttentionLayerInfo``), into one frozen ``LayerKVSpec`` per layer. Every later
decision (cache dtype, fusion, kernel, query dtype, output dtype) reads the layer's own spec;
nothing reads a global cache dtype.
"""

from __future__ import annotations

import enum
import fnmatch
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch

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
    def codes_per_byte(self) -> int:
        """2 for the modes with 4-bit codes (``INT4_PER_TOKEN_HEAD``; ``K8V4_PER_TOKEN_HEAD``'s v),
        1 for every other mode; a cache's last dim is ``head_size // codes_per_byte``."""
        return (
            2 if self in (KVQuantMode.INT4_PER_TOKEN_HEAD, KVQuantMode.K8V4_PER_TOKEN_HEAD) else 1
        )

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


_CODE_DTYPES = {
    KVQuantMode.FP8_PER_TENSOR: FP8_DTYPE,
    KVQuantMode.INT8_PER_TOKEN_HEAD: torch.int8,
    KVQuantMode.FP8_PER_TOKEN_HEAD: FP8_DTYPE,
    KVQuantMode.INT4_PER_TOKEN_HEAD: torch.uint8,
    KVQuantMode.K8V4_PER_TOKEN_HEAD: torch.uint8,  # k's int8 codes stored as their bit patterns
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
            int4; even head sizes only, as int4).
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
    """

    kv_cache_dtype: str = "auto"
    skip_layers: tuple[int | str, ...] = ()
    page_size: int = 16
    kv_scales: tuple[tuple[int | str, tuple[float, float]], ...] = ()
    default_k_scale: float = 1.0
    default_v_scale: float = 1.0
    layer_modes: tuple[tuple[int | str, str], ...] = ()

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
        """K plus V scale bytes one token takes (``kv_scale``): per-(token, head) modes only."""
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
            out[f.name] = (
                v.value
                if isinstance(v, KVQuantMode)
                else (str(v) if isinstance(v, torch.dtype) else v)
            )
        return out


def _rule_matches(rule: int | str, idx: int, info: AttentionLayerInfo, n: int) -> bool:
    if isinstance(rule, int):
        return (rule if rule >= 0 else n + rule) == idx
    if rule == "sliding_window":
        return info.sliding_window is not None
    if rule == "full_attention":
        return info.sliding_window is None
    if any(ch in rule for ch in "*?["):
        return fnmatch.fnmatchcase(info.name, rule)
    return rule == info.name


def _validate_rules(
    rules: Iterable[int | str], layers: Sequence[AttentionLayerInfo], what: str = "skip_layers"
) -> None:
    n = len(layers)
    names = [li.name for li in layers]
    seen: set[int] = set()
    for rule in rules:
        if isinstance(rule, int):
            if not -n <= rule < n:
                raise ValueError(
                    f"{what} index {rule} is out of range for a model with {n} attention "
                    f"layers; expected an int in [{-n}, {n - 1}]"
                )
            idx = rule % n
            if idx in seen:
                raise ValueError(f"{what} names layer index {idx} more than once (rule {rule})")
            seen.add(idx)
        elif rule in ("sliding_window", "full_attention"):
            continue
        elif any(ch in rule for ch in "*?["):
            if not any(fnmatch.fnmatchcase(nm, rule) for nm in names):
                raise ValueError(
                    f"{what} glob {rule!r} matches no layer; layer names look like {names[:2]}"
                )
        elif rule not in names:
            raise ValueError(
                f"unknown skip rule {rule!r}; it is not a layer name. Accepted forms: "
                f"{'; '.join(SKIP_RULE_FORMS)}. Layer names look like {names[:2]}"
            )


def resolve_layer_specs(
    config: KVCacheConfig,
    layers: Sequence[AttentionLayerInfo],
    model_dtype: torch.dtype = torch.bfloat16,
) -> tuple[LayerKVSpec, ...]:
    """Resolve one ``LayerKVSpec`` per attention layer, in layer order.

    Raises ValueError for unknown dtype strings, unknown / out-of-range rules, two rules giving
    one layer different modes, scales for unknown or per-(token, head) layers, and duplicate
    layer names.
    """
    if not isinstance(config, KVCacheConfig):
        raise ValueError(f"config must be a KVCacheConfig, got {type(config).__name__}")
    if model_dtype not in MODEL_DTYPES:
        raise ValueError(
            f"model_dtype {model_dtype} unsupported; expected bfloat16, float16 or float32"
        )
    if not layers:
        raise ValueError("resolve_layer_specs needs at least one attention layer, got none")
    for info in layers:
        _check_layer_info(info)
    names = [li.name for li in layers]
    dup = sorted({nm for nm in names if names.count(nm) > 1})
    if dup:
        raise ValueError(f"duplicate attention layer names {dup}")
    default = _parse_mode(config.kv_cache_dtype, model_dtype)
    _validate_rules(config.skip_layers, layers)
    _validate_rules([r for r, _ in config.layer_modes], layers, "layer_modes")
    rule_modes = [(r, _parse_mode(m, model_dtype), m, src) for r, m, src in config.mode_rules]
    modes = [
        _layer_mode(idx, info, len(layers), rule_modes, default) for idx, info in enumerate(layers)
    ]
    scales = _resolve_scales(config, layers, [m[0] for m, _ in modes])
    any_quantized = default[0].is_quantized or any(m[0].is_quantized for _, m, _, _ in rule_modes)
    specs = []
    for idx, (info, ((mode, storage), reason)) in enumerate(zip(layers, modes)):
        if info.head_size % mode.codes_per_byte:
            raise ValueError(
                f"layer {idx} ({info.name!r}): mode {mode.value!r} packs two 4-bit codes per "  # (v's)
                f"byte, so its head size must be even, got {info.head_size}; give this layer an "
                "8-bit or unquantized mode in layer_modes"
            )
        per_tensor = mode is KVQuantMode.FP8_PER_TENSOR
        k_scale, v_scale = scales.get(info.name, (config.default_k_scale, config.default_v_scale))
        specs.append(
            LayerKVSpec(
                name=info.name,
                index=idx,
                mode=mode,
                storage_dtype=storage,
                model_dtype=model_dtype,
                num_heads=info.num_heads,
                num_kv_heads=info.num_kv_heads,
                head_size=info.head_size,
                page_size=config.page_size,
                sliding_window=info.sliding_window,
                logits_soft_cap=info.logits_soft_cap,
                sm_scale=info.sm_scale,  # None -> LayerKVSpec's default, head_size ** -0.5
                k_scale=float(k_scale) if per_tensor else 1.0,
                v_scale=float(v_scale) if per_tensor else 1.0,
                skip_reason=(
                    reason
                    if (reason is not None and any_quantized and not mode.is_quantized)
                    else None
                ),
                uncalibrated=per_tensor
                and info.name not in scales
                and (config.default_k_scale, config.default_v_scale) == (1.0, 1.0),
            )
        )
    return tuple(specs)


Mode = tuple[KVQuantMode, torch.dtype]


def _parse_mode(kv_cache_dtype: str, model_dtype: torch.dtype) -> Mode:
    """(mode, cache dtype) of a mode string for this model; an unquantized string must name the
    model dtype (or ``auto``)."""
    mode, storage = parse_kv_cache_dtype(kv_cache_dtype, model_dtype)
    if not mode.is_quantized and storage != model_dtype:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} ({storage}) does not match the model dtype "
            f"{model_dtype}; expected 'auto', the model dtype's name, or a quantized mode"
        )
    return mode, storage


def _layer_mode(
    idx: int,
    info: AttentionLayerInfo,
    n: int,
    rule_modes: Sequence[tuple[int | str, Mode, str, str]],
    default: Mode,
) -> tuple[Mode, str | None]:
    """The layer's (mode, cache dtype) and the rule that chose it (None: the default). Two
    matching rules with different modes are a ValueError naming both, the layer and the modes."""
    hits = [(r, m, text, src) for r, m, text, src in rule_modes if _rule_matches(r, idx, info, n)]
    for r, m, text, src in hits[1:]:
        r0, m0, text0, src0 = hits[0]
        if m != m0:
            raise ValueError(
                f"layer {idx} ({info.name!r}) is given two modes: {text0!r} by {src0} rule "
                f"{r0!r} and {text!r} by {src} rule {r!r}; make the rules select disjoint layers"
            )
    if not hits:
        return default, None
    r, m, _, src = hits[0]
    return m, f"{'skip' if src == 'skip_layers' else 'layer_modes'} rule {r!r}"


def _check_layer_info(info: AttentionLayerInfo) -> None:
    if not isinstance(info, AttentionLayerInfo):
        raise ValueError(f"layers must be AttentionLayerInfo, got {type(info).__name__}")
    if not isinstance(info.name, str) or not info.name:
        raise ValueError(f"attention layer name must be a non-empty string, got {info.name!r}")
    for what in ("num_heads", "num_kv_heads", "head_size"):
        v = getattr(info, what)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"layer {info.name!r}: {what} must be a positive int, got {v!r}")
    if info.num_heads % info.num_kv_heads:
        raise ValueError(
            f"layer {info.name!r}: num_heads {info.num_heads} is not a multiple of "
            f"num_kv_heads {info.num_kv_heads}"
        )
    sw = info.sliding_window
    if sw is not None and (isinstance(sw, bool) or not isinstance(sw, int) or sw <= 0):
        raise ValueError(
            f"layer {info.name!r}: sliding_window must be a positive int or None, got {sw!r}"
        )
    for what in ("logits_soft_cap", "sm_scale"):
        if getattr(info, what) is not None:
            check_scale(getattr(info, what), f"layer {info.name!r}: {what}")


def _resolve_scales(
    config: KVCacheConfig, layers: Sequence[AttentionLayerInfo], modes: Sequence[KVQuantMode]
) -> dict[str, tuple[float, float]]:
    n = len(layers)
    names = [li.name for li in layers]
    out: dict[str, tuple[float, float]] = {}
    for key, pair in config.kv_scales:
        if isinstance(key, int):
            if not -n <= key < n:
                raise ValueError(
                    f"kv_scales index {key} is out of range; expected an int in [{-n}, {n - 1}]"
                )
            name = names[key]
        elif key in names:
            name = key
        else:
            raise ValueError(
                f"kv_scales names unknown layer {key!r}; layer names look like {names[:2]}"
            )
        if name in out:
            raise ValueError(f"kv_scales gives layer {name!r} twice (by index and by name)")
        mode = modes[names.index(name)]
        if mode.per_token_head:
            raise ValueError(
                f"kv_scales gives per-tensor scales for layer {name!r}, whose mode {mode.value!r} "
                "computes a scale per (token, kv head) when it writes; give kv_scales only for "
                "fp8 (per-tensor) layers"
            )
        out[name] = (float(pair[0]), float(pair[1]))
    return out


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
                "per token" if s.mode.per_token_head else scale_cell(s, s.k_scale),
                "per token" if s.mode.per_token_head else scale_cell(s, s.v_scale),
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


def scale_cell(spec: LayerKVSpec, scale: float) -> str:
    """A per-tensor scale as the table shows it, marked when it is the uncalibrated 1.0."""
    return f"{scale:.4g}" + (" uncalibrated" if spec.uncalibrated else "")


def spec_table_key(specs: Iterable[LayerKVSpec]) -> str:
    """A stable text form of a spec table, for cache keys (``uuid()``) and reports."""
    return "\n".join(repr(sorted(s.as_dict().items())) for s in sorted(specs, key=lambda s: s.name))
