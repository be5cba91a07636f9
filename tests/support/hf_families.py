"""Shared pieces of the HF integration tests: the tiny families (``torch_kvq.integrations.hf_tiny``),
prompts, HF's reference logits. Not a test module (no ``test_`` prefix)."""

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


def make_prompts(lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lens]


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
