"""A Llama-style decoder on ``torch_kvq.attention.Attention``: RMSNorm, RoPE, GQA, SwiGLU.

Matches transformers' ``LlamaForCausalLM`` (eager attention) given its state dict. Only the
"default" and "linear" rope types are implemented; others are a ValueError.
"""

from __future__ import annotations

import torch
from torch import nn

from torch_kvq.distributed import TensorParallel
from torch_kvq.models.base import GatedMLP, PagedDecoder, RMSNorm, SelfAttention
from torch_kvq.models.config import DecoderConfig


class LlamaDecoderLayer(nn.Module):
    """``h + attn(norm(h))``, then ``h + mlp(norm(h))``. h [T, hidden] -> [T, hidden]."""

    def __init__(
        self,
        cfg: DecoderConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, False, dtype, device)
        self.self_attn = SelfAttention(cfg, qk_norm=False, dtype=dtype, device=device, tp=tp)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, False, dtype, device
        )
        self.mlp = GatedMLP(cfg, dtype, device, tp)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(PagedDecoder):
    """Llama-style causal LM with a paged, per-layer-quantizable KV cache.

    ``LlamaModel(hf_config, kv_config, num_pages, dtype=, device=, prefix=, kernel=, quant_form=)``;
    ``model(input_ids [T], positions [T]) -> logits [T, vocab]`` inside ``model.forward_context(md)``.
    """

    arch = "llama"

    def _make_layer(self, i: int) -> nn.Module:
        return LlamaDecoderLayer(self.config, self.dtype, self.device, self.tp)
