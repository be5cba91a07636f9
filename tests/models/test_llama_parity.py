"""Our Llama-style model against transformers' LlamaForCausalLM (eager), same random weights.

Prompts of lengths 5 / 19 / 12 in one batch (page size 4), then 6 greedy tokens decoded through
our paged cache; transformers sees each full sequence in one forward without a cache.
"""

from __future__ import annotations

import torch

from tests.support.hf_parity import (
    NEW_TOKENS,
    NUM_PAGES,
    PAGE_SIZE,
    bf16_parity_errors,
    check_fp8_caches,
    flat_logits,
    fp32_from_hf,
    hf_model,
    make_prompts,
    max_err,
    teacher_forced_logits,
)
from torch_kvq import KVCacheConfig
from torch_kvq.models import LlamaModel, build_model, generate, tiny_llama_config
from torch_kvq.spec_modes import KVQuantMode

PROMPTS = make_prompts()


def test_fp32_matches_transformers():
    hf = hf_model("llama", torch.float32)
    ours = fp32_from_hf(LlamaModel, hf, tiny_llama_config())
    res = generate(ours, PROMPTS, NEW_TOKENS, prefill_logits=True)
    for i, p in enumerate(PROMPTS):
        ref = teacher_forced_logits(hf, p, res.tokens[i])
        torch.testing.assert_close(flat_logits(res, i), ref, atol=1e-4, rtol=0)
        assert res.tokens[i] == ref[len(p) - 1 :].argmax(-1).tolist()
        assert torch.equal(res.logits[i, 0], res.prefill_logits[i][-1])


def test_bf16_within_bf16_tolerance():
    err = bf16_parity_errors("llama", "llama-tiny", PROMPTS)
    # Logits reach |4|; bf16 rounding over 4 layers costs transformers itself ~0.06-0.12.
    assert err["ours_vs_hf_bf16"] <= 0.15, err
    assert err["ours_vs_hf_fp32"] <= 1.5 * err["hf_bf16_vs_hf_fp32"] + 0.02, err


def test_fp8_kv_close_to_bf16_and_half_the_cache():
    kv8 = KVCacheConfig(kv_cache_dtype="fp8", skip_layers=(-1,), page_size=PAGE_SIZE)
    bf = build_model("llama-tiny", KVCacheConfig(page_size=PAGE_SIZE), num_pages=NUM_PAGES)
    f8 = build_model("llama-tiny", kv8, num_pages=NUM_PAGES)
    ref = generate(bf, PROMPTS, NEW_TOKENS, prefill_logits=True)
    err = max_err(
        ref, generate(f8, PROMPTS, NEW_TOKENS, force_tokens=ref.tokens, prefill_logits=True)
    )
    # Stated FP8 tolerance: e4m3 k/v (3 mantissa bits, unit scales) in 3 of 4 layers moves
    # logits of magnitude <= 4 by at most 0.6 (measured 0.40).
    assert 0.0 < err <= 0.6, err
    assert [s.mode for s in f8.kv_specs] == [KVQuantMode.FP8_PER_TENSOR] * 3 + [KVQuantMode.NONE]
    check_fp8_caches(f8, bf)
