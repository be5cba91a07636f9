"""Tiny model presets with deterministic random weights (no download, no transformers needed).

``tiny_llama_config()`` / ``tiny_gemma3_config()`` return HF config.json-style dicts; our models
take them as they are, and ``transformers.LlamaConfig(**d)`` / ``Gemma3TextConfig(**d)`` builds the
transformers config for parity checks. ``build_model("gemma3-tiny", kv_config)`` builds a model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from torch_kvq.attention.kernels.base import AttentionKernel
from torch_kvq.attention.layer import QuantForm
from torch_kvq.attention.memory import WindowPages
from torch_kvq.distributed import TensorParallel, full_shape, shard_tensor
from torch_kvq.models.base import PagedDecoder
from torch_kvq.models.gemma3 import Gemma3Model
from torch_kvq.models.llama import LlamaModel
from torch_kvq.spec import KVCacheConfig

INIT_STD = 0.08  # larger than HF's 0.02 so that attention is peaked and windows change outputs
NORM_STD = 0.1
_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=INIT_STD,
)


def tiny_llama_config(**overrides: Any) -> dict[str, Any]:
    """4 layers, hidden 128, 4 query / 2 kv heads of 32, vocab 512."""
    return {
        **_COMMON,
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,  # transformers 4.x reads this
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},  # 5.x
        **overrides,
    }


def tiny_gemma3_config(**overrides: Any) -> dict[str, Any]:
    """6 layers, 2 sliding (window 8) : 1 global, hidden 128, 4 query / 2 kv heads of 32, vocab 512.

    ``query_pre_attn_scalar`` is 48 (not head_dim), so using the wrong softmax scale shows.
    """
    return {
        **_COMMON,
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 48,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        "rope_theta": 1_000_000.0,  # transformers 4.x reads these two
        "rope_local_base_freq": 10_000.0,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        **overrides,
    }


PRESETS: Mapping[str, tuple[Callable[..., dict[str, Any]], type[PagedDecoder]]] = {
    "llama-tiny": (tiny_llama_config, LlamaModel),
    "gemma3-tiny": (tiny_gemma3_config, Gemma3Model),
}


@torch.no_grad()
def randomize_weights_(
    module: nn.Module,
    seed: int,
    std: float = INIT_STD,
    norm_offset: bool = False,
    tp: TensorParallel | None = None,
) -> None:
    """Deterministic random weights, by sorted parameter name, from a CPU generator.

    Matrices and embeddings ~ N(0, std); biases ~ N(0, 0.02); norm weights ~ 1 + N(0, 0.1)
    (``N(0, 0.1)`` when ``norm_offset``, Gemma's ``1 + w`` convention). Works on our models and on
    transformers' models alike (same names up to the ``model.`` prefix, so same values). With
    ``tp`` (a tensor-parallel shard) each full weight is drawn and this rank's part kept, so the
    shards hold exactly the single-process model's values.
    """
    gen = torch.Generator().manual_seed(seed)
    named = {name.removeprefix("model."): p for name, p in module.named_parameters()}
    for name in sorted(named):
        p = named[name]
        shape = full_shape(name, p.shape, tp)
        if name.endswith("norm.weight"):
            value = torch.randn(shape, generator=gen) * NORM_STD + (0.0 if norm_offset else 1.0)
        elif name.endswith(".bias"):
            value = torch.randn(shape, generator=gen) * 0.02
        else:
            value = torch.randn(shape, generator=gen) * std
        p.copy_(shard_tensor(name, value, tp).to(dtype=p.dtype, device=p.device))


def build_model(
    preset: str,
    kv_config: KVCacheConfig,
    seed: int = 0,
    *,
    num_pages: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    prefix: str | None = None,
    kernel: AttentionKernel | Mapping[str, AttentionKernel] | None = None,
    quant_form: QuantForm = "op",
    window_pages: WindowPages = None,
    tp: TensorParallel | None = None,
    **config_overrides: Any,
) -> PagedDecoder:
    """A preset model ("llama-tiny" | "gemma3-tiny") with deterministic random weights.

    ``config_overrides`` change the preset's HF config (e.g. ``num_hidden_layers=32``). ``tp``:
    this rank's tensor-parallel shard, holding the same values as the single-process model's.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    make_config, cls = PRESETS[preset]
    model = cls(
        make_config(**config_overrides),
        kv_config,
        num_pages,
        dtype=dtype,
        device=device,
        prefix=prefix,
        kernel=kernel,
        quant_form=quant_form,
        window_pages=window_pages,
        tp=tp,
    )
    randomize_weights_(model, seed, norm_offset=cls is Gemma3Model, tp=tp)
    return model.eval()
