"""What ``KVQCausalLM.from_hf`` refuses at attach, each error naming the layer and the feature.

The paged cache serves causal self-attention with one K and one V per token and layer, the same
head size for q, k and v, and static RoPE positions. Anything else would be served wrongly, so it
is refused before a single cache is allocated: encoder-decoder models, MLA (v head size differs
from the qk head size), attention sinks, chunked attention, non-causal (bidirectional) layers,
cross-layer KV sharing, layer types other than full / sliding attention, and dynamic RoPE.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch_kvq.integrations.hf_attention import HFAttentionCall

SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")
REFUSED_ROPE_TYPES = {
    "dynamic": "its frequencies change with the longest position in the batch (data-dependent)",
}


def _refuse(path: str, feature: str, why: str) -> ValueError:
    return ValueError(f"layer {path!r}: {feature} is not supported by the paged KV cache ({why})")


def check_model(hf_model: Any, text_config: Any) -> None:
    """Model-level refusals: encoder-decoder models, dynamic RoPE."""
    cfg = hf_model.config
    if any(getattr(c, "is_encoder_decoder", False) for c in (cfg, text_config)):
        raise ValueError(
            f"{type(hf_model).__name__} is an encoder-decoder model; torch-kvq attaches decoder-only "
            "causal language models (and the text decoder of multimodal ones)"
        )
    for rope_type in sorted(rope_types(text_config)):
        if rope_type in REFUSED_ROPE_TYPES:
            raise ValueError(
                f"{type(hf_model).__name__} uses rope_type {rope_type!r}, which the flat token batch "
                f"cannot serve: {REFUSED_ROPE_TYPES[rope_type]}"
            )


def rope_types(config: Any) -> set[str]:
    """RoPE types named by a config: 5.x ``rope_parameters`` (flat or per layer type), 4.x
    ``rope_scaling``."""
    found: set[str] = set()
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(config, attr, None)
        if not isinstance(params, dict) or not params:
            continue
        groups = params.values() if all(isinstance(v, dict) for v in params.values()) else [params]
        for group in groups:
            kind = group.get("rope_type", group.get("type"))
            if isinstance(kind, str):
                found.add(kind)
    return found


def check_layer(call: HFAttentionCall, path: str, text_config: Any) -> None:
    """Per-layer refusals, from what the layer passed in the dry run and its config entry."""
    module = call.module
    idx = getattr(module, "layer_idx", None)
    layer_types: Sequence[str] | None = getattr(text_config, "layer_types", None)
    layer_type = layer_types[idx] if layer_types is not None and isinstance(idx, int) else None
    if layer_type == "chunked_attention" or (
        getattr(text_config, "attention_chunk_size", None) and layer_type is None
    ):
        raise _refuse(path, "chunked attention", "each query sees only its own chunk of keys")
    if layer_type is not None and layer_type not in SERVED_LAYER_TYPES:
        raise _refuse(
            path, f"layer type {layer_type!r}", f"the paged cache serves {list(SERVED_LAYER_TYPES)}"
        )
    if call.v_head_size != call.head_size or call.k_head_size != call.head_size:
        raise _refuse(
            path,
            "MLA / unequal head sizes",
            f"q head size {call.head_size}, k {call.k_head_size}, v {call.v_head_size}; the cache "
            "stores k and v with one head size",
        )
    if call.sinks or any(
        getattr(module, a, None) is not None for a in ("sinks", "s_aux", "attention_sinks")
    ):
        raise _refuse(path, "attention sinks", "per-head sink logits join the softmax")
    if not call.is_causal:
        raise _refuse(
            path, "non-causal (bidirectional) attention", "the cache serves causal layers"
        )
    modes = getattr(text_config, "kv_sharing_modes", None)
    shared = getattr(module, "is_kv_shared_layer", False) or (
        modes is not None and isinstance(idx, int) and modes[idx] == "reuse"
    )
    if shared:
        raise _refuse(
            path, "cross-layer KV sharing", "the layer reads another layer's K/V instead of its own"
        )
    if call.num_heads % call.num_kv_heads:
        raise _refuse(
            path,
            f"{call.num_heads} query heads over {call.num_kv_heads} KV heads",
            "query heads must be a multiple of KV heads",
        )
