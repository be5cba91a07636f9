"""Shared pieces of the HF integration tests: the tiny families (``torch_kvq.integrations.hf_tiny``),
prompts, HF's reference logits, and the GPU tests' Gemma-3-shaped model (also built by
``scripts/hf_copies_diff.py``). Not a test module (no ``test_`` prefix)."""

from __future__ import annotations

import copy
import gc

import torch
from torch import nn

from torch_kvq.integrations.hf_tiny import BASE, FAMILIES, SLIDING, WINDOW, tiny_hf_model
from torch_kvq.models import GenerateResult

__all__ = ["FAMILIES", "SLIDING", "WINDOW"]
VOCAB = BASE["vocab_size"]
PAGE_SIZE = 4
NUM_PAGES = 48
PROMPT_LENS = (5, 19, 12)  # one batch, different lengths; 19 and 12 exceed the window of 8
NEW_TOKENS = 5  # the prefill's token, then 4 decode steps
hf_model = tiny_hf_model


def twins(
    family: str, dtype: torch.dtype = torch.float32, **overrides
) -> tuple[nn.Module, nn.Module]:
    """(a model to attach, an identical untouched eager reference)."""
    model = hf_model(family, dtype, **overrides)
    return model, copy.deepcopy(model)


def make_prompts(lens: tuple[int, ...] = PROMPT_LENS, vocab: int = VOCAB) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


@torch.no_grad()
def hf_logits(ref: nn.Module, prompt: list[int], new_tokens: list[int]) -> torch.Tensor:
    """HF's logits over prompt + new_tokens[:-1], one forward without a cache: [L, vocab] fp32."""
    return ref(torch.tensor([prompt + new_tokens[:-1]]), use_cache=False).logits[0].float()


def flat_logits(res: GenerateResult, i: int) -> torch.Tensor:
    """Our logits of sequence i over the positions ``hf_logits`` covers: [L, vocab]."""
    return torch.cat([res.prefill_logits[i], res.logits[i, 1:]])


def release() -> None:
    """Drop dead models (their layer names become free again) and Dynamo's compiled frames."""
    torch._dynamo.reset()
    gc.collect()


GEMMA3_WINDOW = 1024
GEMMA3_PROMPT_LENS = (1100, 300, 40)  # they cross the window
GEMMA3_VOCAB = 512


def gemma3_shaped(device: str = "cuda") -> nn.Module:
    """The tiny Gemma-3 family at real shapes (head 256, 5 sliding layers : 1 global, window
    ``GEMMA3_WINDOW``), random weights (seed 0), bf16 on ``device``."""
    return hf_model(
        "gemma3", torch.bfloat16, vocab_size=GEMMA3_VOCAB, hidden_size=256,
        intermediate_size=512, num_hidden_layers=6, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=GEMMA3_WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=4096, tie_word_embeddings=True,
    ).to(device)  # fmt: skip


def gemma3_prompts() -> list[list[int]]:
    """The Gemma-3-shaped model's prompts (``GEMMA3_PROMPT_LENS`` tokens)."""
    return make_prompts(GEMMA3_PROMPT_LENS, GEMMA3_VOCAB)
