"""Tiny random-weight transformers models of several families, built from configs (no download):
the families ``tests/integrations`` checks and ``kvq demo --hf`` runs.

Every family has 4 layers, 4 query / 2 KV heads of 16, vocab 256; the sliding families a window of
8 (Mistral: every layer; Qwen2, Gemma 2: alternating; Gemma 3: 2 sliding : 1 global). Weights are
``randomize_weights_(seed)`` (std 0.08, so attention is peaked and windows change outputs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported when a model is built (``kvq <sub> --help`` stays fast)
    import torch
    from torch import nn

WINDOW = 8
BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.08,
    tie_word_embeddings=False,
)
_ALTERNATING = ["sliding_attention", "full_attention"] * 2
# family -> (config class name, model class name, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=_ALTERNATING),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            sliding_window=WINDOW,
            layer_types=_ALTERNATING,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"]
            + ["sliding_attention"],
            query_pre_attn_scalar=24,
        ),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # fused qkv_proj
}
SLIDING = ("mistral", "qwen2", "gemma2", "gemma3")


def tiny_hf_config(family: str, **overrides: Any) -> Any:
    """The family's transformers config (eager attention) with ``overrides``."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {sorted(FAMILIES)}")
    config_cls, _, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**BASE, **extra, **overrides})
    config._attn_implementation = "eager"
    return config


def tiny_hf_model(
    family: str, dtype: torch.dtype | None = None, seed: int = 0, **overrides: Any
) -> nn.Module:
    """A fresh eager-attention ``*ForCausalLM`` with deterministic random weights, eval mode
    (``dtype`` None: float32)."""
    import torch
    import transformers

    from torch_kvq.models import randomize_weights_

    config = tiny_hf_config(family, **overrides)
    cls = getattr(transformers, FAMILIES[family][1])
    model = cls._from_config(config).to(dtype or torch.float32).eval()
    randomize_weights_(model, seed, norm_offset=family.startswith("gemma"))
    return model
