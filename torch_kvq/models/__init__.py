"""Small reference decoders on the paged, per-layer-quantizable KV cache, plus greedy generation."""

from torch_kvq.models.base import PagedDecoder
from torch_kvq.models.gemma3 import Gemma3Model
from torch_kvq.models.generate import GenerateResult, generate
from torch_kvq.models.llama import LlamaModel
from torch_kvq.models.presets import (
    PRESETS,
    build_model,
    randomize_weights_,
    tiny_gemma3_config,
    tiny_llama_config,
)

__all__ = [
    "PRESETS",
    "Gemma3Model",
    "GenerateResult",
    "LlamaModel",
    "PagedDecoder",
    "build_model",
    "generate",
    "randomize_weights_",
    "tiny_gemma3_config",
    "tiny_llama_config",
]
