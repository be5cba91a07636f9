"""Read a Hugging Face model config (a transformers config object or a config.json dict).

``DecoderConfig`` is the small, validated subset our models use. Both rope shapes are read:
transformers 5.x ``rope_parameters`` (per layer type for Gemma 3) and 4.x ``rope_theta`` /
``rope_local_base_freq`` / ``rope_scaling``. Anything we do not implement is a ValueError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

_MISSING = object()


def _get(cfg: Any, key: str, default: Any = _MISSING) -> Any:
    value = cfg.get(key, _MISSING) if isinstance(cfg, Mapping) else getattr(cfg, key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise ValueError(f"model config has no {key!r}; expected a Hugging Face config with it")
        return default
    return value


def _pos_int(cfg: Any, key: str, default: Any = _MISSING) -> int:
    v = _get(cfg, key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"model config {key} must be a positive int, got {v!r}")
    return v


@dataclass(frozen=True)
class RopeSpec:
    """RoPE for one layer type: ``inv_freq = 1 / theta ** (2i / head_dim) / factor``."""

    theta: float
    factor: float = 1.0  # linear position scaling ("linear" rope_type); 1.0 for "default"


@dataclass(frozen=True)
class DecoderConfig:
    """What our decoders read from an HF config, validated."""

    arch: str  # "llama" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope: Mapping[str, RopeSpec]  # layer type -> rope
    sm_scale: float
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None


def _rope_spec(params: Mapping[str, Any], where: str, default_theta: float) -> RopeSpec:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{where}: rope_type {rope_type!r} is not supported; expected one of {ROPE_TYPES}"
        )
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(
            f"{where}: partial_rotary_factor {partial!r} is not supported; expected 1.0"
        )
    theta = float(params.get("rope_theta", default_theta))
    factor = float(params.get("factor", 1.0)) if rope_type == "linear" else 1.0
    if not theta > 0 or not factor > 0:
        raise ValueError(f"{where}: rope_theta {theta} and factor {factor} must be positive")
    return RopeSpec(theta=theta, factor=factor)


def _as_dict(x: Any, where: str) -> Mapping[str, Any]:
    if x is None:
        return {}
    if not isinstance(x, Mapping):
        raise ValueError(f"{where} must be a dict or None, got {type(x).__name__}")
    return x


def _llama_rope(cfg: Any) -> dict[str, RopeSpec]:
    params = _get(cfg, "rope_parameters", None)
    if params:  # transformers 5.x
        spec = _rope_spec(_as_dict(params, "rope_parameters"), "rope_parameters", 10000.0)
        return {"full_attention": spec}
    merged = {"rope_theta": _get(cfg, "rope_theta", 10000.0)}  # transformers 4.x
    merged.update(_as_dict(_get(cfg, "rope_scaling", None), "rope_scaling"))
    return {"full_attention": _rope_spec(merged, "rope_scaling", 10000.0)}


def _gemma3_rope(cfg: Any) -> dict[str, RopeSpec]:
    params = _get(cfg, "rope_parameters", None)
    if params and set(params) & set(LAYER_TYPES):  # transformers 5.x: one dict per layer type
        params = _as_dict(params, "rope_parameters")
        where = "rope_parameters[{!r}]"
        return {
            t: _rope_spec(_as_dict(params.get(t), "rope_parameters"), where.format(t), theta)
            for t, theta in (("full_attention", 1e6), ("sliding_attention", 1e4))
        }
    glob = {"rope_theta": _get(cfg, "rope_theta", 1e6)}  # transformers 4.x
    glob.update(_as_dict(_get(cfg, "rope_scaling", None), "rope_scaling"))
    local = {"rope_theta": _get(cfg, "rope_local_base_freq", 1e4)}
    return {
        "full_attention": _rope_spec(glob, "rope_scaling", 1e6),
        "sliding_attention": _rope_spec(local, "rope_local_base_freq", 1e4),
    }


def _layer_types(cfg: Any, n: int) -> tuple[str, ...]:
    types = _get(cfg, "layer_types", None)
    if types is None:  # transformers 4.x before layer_types: every pattern-th layer is global
        pattern = _pos_int(cfg, "sliding_window_pattern", 6)
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
        ]
    types = tuple(types)
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types {list(types)} must list {n} entries from {LAYER_TYPES}")
    return types


def _opt_float(cfg: Any, key: str) -> float | None:
    v = _get(cfg, key, None)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"model config {key} must be a positive float or None, got {v!r}")
    return float(v)


def read_config(cfg: Any, arch: str) -> DecoderConfig:
    """Validate ``cfg`` (HF config object or dict) for ``arch`` ("llama" or "gemma3")."""
    if arch not in ("llama", "gemma3"):
        raise ValueError(f"unknown arch {arch!r}; expected 'llama' or 'gemma3'")
    n = _pos_int(cfg, "num_hidden_layers")
    heads = _pos_int(cfg, "num_attention_heads")
    hidden = _pos_int(cfg, "hidden_size")
    kv_heads = _pos_int(cfg, "num_key_value_heads", heads)
    head_dim = _get(cfg, "head_dim", None) or hidden // heads
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    if arch == "llama":
        act = _get(cfg, "hidden_act", "silu")
        types, window = ("full_attention",) * n, None
        rope = _llama_rope(cfg)
        sm_scale = head_dim**-0.5
        attn_cap = final_cap = None
        tie = bool(_get(cfg, "tie_word_embeddings", False))
    else:
        if _get(cfg, "use_bidirectional_attention", False):
            raise ValueError(
                "use_bidirectional_attention=True is not supported; expected a causal decoder"
            )
        act = _get(cfg, "hidden_activation", None) or _get(cfg, "hidden_act", "gelu_pytorch_tanh")
        types = _layer_types(cfg, n)
        window = _pos_int(cfg, "sliding_window") if "sliding_attention" in types else None
        rope = _gemma3_rope(cfg)
        sm_scale = float(_get(cfg, "query_pre_attn_scalar", 256)) ** -0.5
        attn_cap = _opt_float(cfg, "attn_logit_softcapping")
        final_cap = _opt_float(cfg, "final_logit_softcapping")
        tie = bool(_get(cfg, "tie_word_embeddings", True))
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not supported; expected one of {ACTIVATIONS}")
    return DecoderConfig(
        arch=arch,
        vocab_size=_pos_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_pos_int(cfg, "intermediate_size"),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        hidden_act=act,
        tie_word_embeddings=tie,
        attention_bias=bool(_get(cfg, "attention_bias", False)),
        mlp_bias=bool(_get(cfg, "mlp_bias", False)),
        layer_types=types,
        sliding_window=window,
        rope=rope,
        sm_scale=sm_scale,
        attn_logit_softcapping=attn_cap,
        final_logit_softcapping=final_cap,
    )
