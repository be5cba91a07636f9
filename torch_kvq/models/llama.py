"""A Llama-style decoder on ``torch_kvq.attention.Attention``: RMSNorm, RoPE, GQA, SwiGLU.

Matches transformers' ``LlamaForCausalLM`` (eager attention) given its state dict. Only the
"default" and "linear" rope types are implemented; others are a ValueError.
"""

from __future__ import annotations

import torch

from torch_kvq.models.base import DecoderLayer, PagedDecoder


class LlamaDecoderLayer(DecoderLayer):
    """``h + attn(norm(h))``, then ``h + mlp(norm(h))``. h [T, hidden] -> [T, hidden]."""

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(PagedDecoder):
    """Llama-style causal LM with a paged, per-layer-quantizable KV cache (``PagedDecoder``)."""

    arch = "llama"
    layer_class = LlamaDecoderLayer
