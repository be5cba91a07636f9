"""A Gemma-3-style text decoder on ``torch_kvq.attention.Attention``.

Mixed sliding-window / global layers (``layer_types``, ``sliding_window``), per-head q/k RMSNorm,
``query_pre_attn_scalar ** -0.5`` as the softmax scale, separate RoPE bases for local and global
layers, embeddings scaled by ``sqrt(hidden)`` (rounded to the model dtype, as transformers does),
sandwich norms around attention and MLP, GeGLU (gelu tanh) MLP, optional attention / final logit
soft-caps. Matches transformers' ``Gemma3ForCausalLM`` (eager attention) given its state dict.

Sliding window: a query at position p sees keys k with ``p - window < k <= p`` (the window counts
the query itself), the same set as transformers' ``sliding_window_overlay`` + causal mask.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_kvq.models.base import DecoderLayer, PagedDecoder


class Gemma3DecoderLayer(DecoderLayer):
    """``h + post_attn_norm(attn(in_norm(h)))``, then ``h + post_ff_norm(mlp(pre_ff_norm(h)))``."""

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(PagedDecoder):
    """Gemma-3-style causal LM with a paged, per-layer-quantizable KV cache (same API as
    ``LlamaModel``). Sliding-window layers are the ones ``skip_layers=("sliding_window",)`` keeps
    in the model dtype."""

    arch = "gemma3"
    layer_class = Gemma3DecoderLayer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # sqrt(hidden) rounded to the model dtype, as transformers applies it. A Python float
        # computed once, so tracing sees a constant (no tensor -> float inside forward).
        self.embed_scale = float(torch.tensor(self.config.hidden_size**0.5).to(self.dtype))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale
