"""Helpers for the parity tests: transformers reference models with our preset weights.

Not a test module (no ``test_`` prefix); the parity tests import it by name.
"""

from __future__ import annotations

import torch
import transformers  # a dev dependency (pip install -e .[dev]); parity needs it

from torch_kvq import KVCacheConfig
from torch_kvq.models import (
    GenerateResult,
    PagedDecoder,
    build_model,
    generate,
    randomize_weights_,
    tiny_gemma3_config,
    tiny_llama_config,
)

PROMPT_LENS = (5, 19, 12)  # one batch, different lengths; 19 and 12 exceed the window of 8
PAGE_SIZE = 4  # several pages per sequence; decode crosses page boundaries
NEW_TOKENS = 6
NUM_PAGES = 32


def make_prompts(lens: tuple[int, ...] = PROMPT_LENS, vocab: int = 512) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


_HF_MODELS: dict[str, torch.nn.Module] = {}


def hf_model(arch: str, dtype: torch.dtype, **overrides: object) -> torch.nn.Module:
    """transformers' ``*ForCausalLM`` (eager attention) with ``randomize_weights_(seed=0)``."""
    key = repr((arch, dtype, sorted(overrides.items())))
    if key not in _HF_MODELS:
        _HF_MODELS[key] = _make_hf_model(arch, dtype, **overrides)
    return _HF_MODELS[key]


def _make_hf_model(arch: str, dtype: torch.dtype, **overrides: object) -> torch.nn.Module:
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **tiny_llama_config(**overrides), attn_implementation="eager"
        )
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Gemma3TextConfig(
            **tiny_gemma3_config(**overrides), attn_implementation="eager"
        )
        cls = transformers.Gemma3ForCausalLM
    model = cls._from_config(cfg, dtype=dtype).eval()
    randomize_weights_(model, 0, norm_offset=arch == "gemma3")
    return model


@torch.no_grad()
def teacher_forced_logits(
    hf: torch.nn.Module, prompt: list[int], new_tokens: list[int]
) -> torch.Tensor:
    """transformers' logits over prompt + new_tokens[:-1], one forward, no cache: [L, vocab]."""
    return hf(torch.tensor([prompt + new_tokens[:-1]]), use_cache=False).logits[0].float()


def flat_logits(res: GenerateResult, i: int) -> torch.Tensor:
    """Our logits of sequence i at the positions ``teacher_forced_logits`` covers: [L, vocab]."""
    return torch.cat([res.prefill_logits[i], res.logits[i, 1:]])


def max_err(a: GenerateResult, b: GenerateResult) -> float:
    """Largest |a - b| logit difference over prefill and decode (b forced along a's tokens)."""
    return max(
        (flat_logits(a, i) - flat_logits(b, i)).abs().max().item() for i in range(len(a.tokens))
    )


def max_err_vs_hf(res: GenerateResult, hf: torch.nn.Module, prompts: list[list[int]]) -> float:
    """Largest |ours - transformers| over prefill and every decode step of every sequence."""
    return max(
        (flat_logits(res, i) - teacher_forced_logits(hf, p, res.tokens[i])).abs().max().item()
        for i, p in enumerate(prompts)
    )


def fp32_from_hf(cls: type[PagedDecoder], hf: torch.nn.Module, hf_config: dict) -> PagedDecoder:
    """Our fp32 model, weights loaded with ``load_hf_state_dict``."""
    ours = cls(hf_config, KVCacheConfig(page_size=PAGE_SIZE), NUM_PAGES, dtype=torch.float32)
    ours.load_hf_state_dict(hf.state_dict())
    return ours


def bf16_parity_errors(arch: str, preset: str, prompts: list[list[int]]) -> dict[str, float]:
    """Max |logit| errors of our bf16 ``build_model`` model and of transformers' bf16 model."""
    hf32, hf16 = hf_model(arch, torch.float32), hf_model(arch, torch.bfloat16)
    ours = build_model(preset, KVCacheConfig(page_size=PAGE_SIZE), num_pages=NUM_PAGES)
    theirs = {k.removeprefix("model."): v for k, v in hf16.state_dict().items()}
    mismatched = [k for k, v in ours.state_dict().items() if not torch.equal(v, theirs[k])]
    assert not mismatched, f"build_model weights differ from transformers' for {mismatched[:3]}"
    res = generate(ours, prompts, NEW_TOKENS, prefill_logits=True)
    hf16_vs_32 = max(
        (
            teacher_forced_logits(hf16, p, res.tokens[i])
            - teacher_forced_logits(hf32, p, res.tokens[i])
        )
        .abs()
        .max()
        .item()
        for i, p in enumerate(prompts)
    )
    return {
        "ours_vs_hf_bf16": max_err_vs_hf(res, hf16, prompts),
        "ours_vs_hf_fp32": max_err_vs_hf(res, hf32, prompts),
        "hf_bf16_vs_hf_fp32": hf16_vs_32,
    }


def check_fp8_caches(f8: PagedDecoder, bf: PagedDecoder) -> None:
    """FP8 layers' caches are float8_e4m3fn with half the bytes; skipped ones are the model dtype."""
    for a8, a16 in zip(f8.attention_layers, bf.attention_layers):
        assert a8.kv_cache.shape == a16.kv_cache.shape
        if a8.spec.is_quantized:
            assert a8.kv_cache.dtype == torch.float8_e4m3fn, a8.spec.name
            assert a8.kv_cache.nbytes * 2 == a16.kv_cache.nbytes, a8.spec.name
        else:
            assert a8.kv_cache.dtype == bf.dtype == torch.bfloat16, a8.spec.name
            assert a8.kv_cache.nbytes == a16.kv_cache.nbytes, a8.spec.name
