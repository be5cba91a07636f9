"""Per-layer resolution: ``KVCacheConfig`` plus the model's attention layers -> ``LayerKVSpec``s.

Apart from ``spec`` so that the data types stay small; this is the one place the config's rules,
modes and scales are matched to layers and checked against them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, Sequence

import torch

from torch_kvq.spec import (
    MODEL_DTYPES,
    SKIP_RULE_FORMS,
    AttentionLayerInfo,
    KVCacheConfig,
    LayerKVSpec,
    check_scale,
)
from torch_kvq.spec_channels import KBasis, KChannelScale
from torch_kvq.spec_modes import TC4_HEAD_MULTIPLE, KVQuantMode, parse_kv_cache_dtype


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


def layer_modes(
    config: KVCacheConfig,
    layers: Sequence[AttentionLayerInfo],
    model_dtype: torch.dtype = torch.bfloat16,
) -> tuple[KVQuantMode, ...]:
    """Each layer's mode under ``config``'s rules, without the per-layer tables (scales, K
    channel scales, K bases) a full resolve checks: which layers a table must cover."""
    return tuple(m for (m, _), _ in _layer_modes(config, layers, model_dtype))


def _layer_modes(
    config: KVCacheConfig, layers: Sequence[AttentionLayerInfo], model_dtype: torch.dtype
) -> list[tuple[Mode, str | None]]:
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
    return [
        _layer_mode(idx, info, len(layers), rule_modes, default) for idx, info in enumerate(layers)
    ]


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
    modes = _layer_modes(config, layers, model_dtype)
    rule_modes = [(r, _parse_mode(m, model_dtype), m, src) for r, m, src in config.mode_rules]
    default = _parse_mode(config.kv_cache_dtype, model_dtype)
    scales = _resolve_scales(config, layers, [m[0] for m, _ in modes])
    channels = _resolve_k_channels(config, layers, [m[0] for m, _ in modes])
    bases = _resolve_k_bases(config, layers, [m[0] for m, _ in modes])
    any_quantized = default[0].is_quantized or any(m[0].is_quantized for _, m, _, _ in rule_modes)
    specs = []
    for idx, (info, ((mode, storage), reason)) in enumerate(zip(layers, modes)):
        if info.head_size % mode.codes_per_byte:
            raise ValueError(
                f"layer {idx} ({info.name!r}): mode {mode.value!r} packs two 4-bit codes per "  # (v's)
                f"byte, so its head size must be even, got {info.head_size}; give this layer an "
                "8-bit or unquantized mode in layer_modes"
            )
        if mode.transform_coded:
            _check_tc4_layer(idx, info, bases)
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
                k_channel=channels.get(info.name),
                k_basis=bases.get(info.name),
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
    names = [li.name for li in layers]
    out: dict[str, tuple[float, float]] = {}
    for key, pair in config.kv_scales:
        name = _layer_of_key(key, names, "kv_scales")
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


def _layer_of_key(key: int | str, names: Sequence[str], what: str) -> str:
    """The layer name a ``kv_scales`` / ``k_channel_scales`` key (index or name) selects."""
    n = len(names)
    if isinstance(key, int):
        if not -n <= key < n:
            raise ValueError(
                f"{what} index {key} is out of range; expected an int in [{-n}, {n - 1}]"
            )
        return names[key]
    if key in names:
        return key
    raise ValueError(f"{what} names unknown layer {key!r}; layer names look like {list(names[:2])}")


def _table_entries(
    table: Sequence[tuple[int | str, object]],
    what: str,
    layers: Sequence[AttentionLayerInfo],
    modes: Sequence[KVQuantMode],
) -> Iterator[tuple[str, AttentionLayerInfo, KVQuantMode, object]]:
    """(layer name, info, mode, value) of each entry of a per-layer table (``what``: its field),
    keys by index or name; a layer given twice is a ValueError."""
    names = [li.name for li in layers]
    seen: set[str] = set()
    for key, value in table:
        name = _layer_of_key(key, names, what)
        if name in seen:
            raise ValueError(f"{what} gives layer {name!r} twice (by index and by name)")
        seen.add(name)
        i = names.index(name)
        yield name, layers[i], modes[i], value


def _resolve_k_channels(
    config: KVCacheConfig, layers: Sequence[AttentionLayerInfo], modes: Sequence[KVQuantMode]
) -> dict[str, KChannelScale]:
    """Layer name -> its ``KChannelScale``: int4 layers only, of the layer's [KH][D] shape, and
    not centred where a soft cap makes the scores' constant shift matter."""
    out: dict[str, KChannelScale] = {}
    for name, info, mode, ch in _table_entries(
        config.k_channel_scales, "k_channel_scales", layers, modes
    ):
        if mode is not KVQuantMode.INT4_PER_TOKEN_HEAD:
            raise ValueError(
                f"k_channel_scales gives layer {name!r}, whose mode is {mode.value!r}; K channel "
                "scaling is an option of int4_per_token_head layers only (drop the entry or give "
                "the layer that mode)"
            )
        if ch.shape != (info.num_kv_heads, info.head_size):
            raise ValueError(
                f"k_channel_scales for layer {name!r} is {ch.shape[0]} x {ch.shape[1]}; expected "
                f"num_kv_heads x head_size = {info.num_kv_heads} x {info.head_size}"
            )
        if ch.mean is not None and info.logits_soft_cap is not None:
            raise ValueError(
                f"k_channel_scales centres k of layer {name!r}, which caps its logits "
                f"(logits_soft_cap {info.logits_soft_cap}): the cap makes the shift of every "
                "score by q . mean change the softmax; give that layer a scale without a mean"
            )
        out[name] = ch
    return out


def _check_tc4_layer(idx: int, info: AttentionLayerInfo, bases: dict[str, KBasis]) -> None:
    """A ``tc4_per_token_head`` layer: head size a multiple of 16, and its ``KBasis`` given."""
    if info.head_size % TC4_HEAD_MULTIPLE:
        raise ValueError(
            f"layer {idx} ({info.name!r}): mode 'tc4_per_token_head' packs the one-bit codes "
            "of half the channels 8 to a byte (D / 16 bytes), so its head size must be a "
            f"multiple of {TC4_HEAD_MULTIPLE}, got {info.head_size}; give this layer another "
            "mode in layer_modes"
        )
    if info.name not in bases:
        raise ValueError(
            f"layer {idx} ({info.name!r}) has mode 'tc4_per_token_head', which needs the layer's "
            "calibrated K basis: give it in k_bases (kvq calibrate writes them; from_hf's "
            "k_bases_from=, the command line's --k-bases PATH, kvq eval's basis=PATH or "
            "basis=calibrate read them)"
        )


def _resolve_k_bases(
    config: KVCacheConfig, layers: Sequence[AttentionLayerInfo], modes: Sequence[KVQuantMode]
) -> dict[str, KBasis]:
    """Layer name -> its ``KBasis``: tc4 layers only, of the layer's [KH, D, D] shape."""
    out: dict[str, KBasis] = {}
    for name, info, mode, basis in _table_entries(config.k_bases, "k_bases", layers, modes):
        if not mode.transform_coded:
            raise ValueError(
                f"k_bases gives layer {name!r}, whose mode is {mode.value!r}; a K basis is for "
                "tc4_per_token_head layers only (drop the entry or give the layer that mode)"
            )
        want = (info.num_kv_heads, info.head_size, info.head_size)
        if basis.shape != want:
            raise ValueError(
                f"k_bases for layer {name!r} is {basis.shape}; expected (num_kv_heads, head_size, "
                f"head_size) = {want}"
            )
        out[name] = basis
    return out
