"""Unmodified transformers models on the paged cache (``KVQCausalLM.from_hf``), eager.

fp32: logits equal HF's own eager model within 1e-4 over a mixed batch of prompts of lengths
5 / 19 / 12 (page size 4; window 8 in the sliding families), prefill and 4 decode steps.
bf16 with kv "auto" (and FP8): logits equal torch_kvq's own decoders on the same weights, bit for
bit (same ops, same kernel). Layer facts come from what HF passes in a one-token dry run.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.hf_families import (
    FAMILIES,
    NEW_TOKENS,
    NUM_PAGES,
    PAGE_SIZE,
    SLIDING,
    WINDOW,
    flat_logits,
    hf_logits,
    make_prompts,
    twins,
)
from tests.support.hf_parity import hf_model as parity_hf_model  # noqa: E402
from torch_kvq import KVCacheConfig
from torch_kvq.integrations.transformers import KVQCausalLM
from torch_kvq.models import build_model, generate

PROMPTS = make_prompts()
AUTO = KVCacheConfig(page_size=PAGE_SIZE)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp32_logits_equal_hf_eager(family):
    hf, ref = twins(family)
    lm = KVQCausalLM.from_hf(hf, AUTO, num_pages=NUM_PAGES)
    res = generate(lm, PROMPTS, NEW_TOKENS, prefill_logits=True)
    for i, p in enumerate(PROMPTS):
        want = hf_logits(ref, p, res.tokens[i])
        torch.testing.assert_close(flat_logits(res, i), want, atol=1e-4, rtol=0)
        assert res.tokens[i] == want[len(p) - 1 :].argmax(-1).tolist()
    assert lm.allocator.sequences == ()  # generate freed every page


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_facts_come_from_hf(family):
    hf, _ = twins(family)
    lm = KVQCausalLM.from_hf(hf, AUTO, num_pages=NUM_PAGES)
    cfg = hf.config
    names = [s.name for s in lm.kv_specs]
    assert names == [f"model.layers.{i}.self_attn" for i in range(cfg.num_hidden_layers)]
    for s, mod in zip(lm.kv_specs, (layer.self_attn for layer in hf.model.layers)):
        assert (s.num_heads, s.num_kv_heads, s.head_size) == (4, 2, 16)
        assert s.sm_scale == pytest.approx(mod.scaling)
        assert mod.kvq_attn is lm.attention_layers[s.index]
    windows = [s.sliding_window for s in lm.kv_specs]
    types = getattr(cfg, "layer_types", None)
    if family == "mistral":
        assert windows == [WINDOW] * 4
    elif family in SLIDING:
        assert windows == [WINDOW if t == "sliding_attention" else None for t in types]
    else:
        assert windows == [None] * 4
    caps = {s.logits_soft_cap for s in lm.kv_specs}
    # Gemma 2 passes softcap=; Gemma 3 stores attn_logit_softcapping but never passes it
    assert caps == ({5.0} if family == "gemma2" else {None})
    if family in ("gemma2", "gemma3"):
        assert all(s.sm_scale == pytest.approx(24**-0.5) for s in lm.kv_specs)


@pytest.mark.parametrize(
    "arch,preset,fp8_skip",
    [("llama", "llama-tiny", (-1,)), ("gemma3", "gemma3-tiny", ("sliding_window",))],
)
def test_bf16_equals_our_own_decoder(arch, preset, fp8_skip):
    """Same weights, same ops, same kernel: bit-equal logits, kv "auto" and FP8 alike."""
    hf = parity_hf_model(arch, torch.bfloat16)
    ours = build_model(preset, AUTO, num_pages=32)
    lm = KVQCausalLM.from_hf(hf, AUTO, num_pages=32)
    try:  # hf is hf_parity's cached model: give it back whatever happens
        prompts = make_prompts()
        for cfg in (AUTO, KVCacheConfig("fp8", skip_layers=fp8_skip, page_size=PAGE_SIZE)):
            ours.configure_kv(cfg)
            lm.configure_kv(cfg)
            assert [s.mode for s in lm.kv_specs] == [s.mode for s in ours.kv_specs]
            a = generate(ours, prompts, NEW_TOKENS, prefill_logits=True)
            b = generate(lm, prompts, NEW_TOKENS, force_tokens=a.tokens, prefill_logits=True)
            assert b.tokens == a.tokens
            for i in range(len(prompts)):
                assert torch.equal(flat_logits(a, i), flat_logits(b, i)), (cfg, i)
    finally:
        lm.detach()


def test_multimodal_attaches_the_text_decoder_only():
    import transformers

    from torch_kvq.models import randomize_weights_

    text = dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    cfg = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
        boi_token_index=297, eoi_token_index=298, attn_implementation="eager",
    )  # fmt: skip
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    randomize_weights_(hf, 0, norm_offset=True)
    import copy

    ref = copy.deepcopy(hf)
    lm = KVQCausalLM.from_hf(hf, AUTO, num_pages=NUM_PAGES)
    assert [s.name for s in lm.kv_specs] == [
        f"model.language_model.layers.{i}.self_attn" for i in range(3)
    ]
    assert [s.sliding_window for s in lm.kv_specs] == [WINDOW, WINDOW, None]
    assert cfg.text_config._attn_implementation == "kvq"
    assert cfg.vision_config._attn_implementation == "eager"  # the tower keeps its own
    prompts = PROMPTS[:2]
    res = generate(lm, prompts, 3, prefill_logits=True)
    for i, p in enumerate(prompts):
        want = hf_logits(ref, p, res.tokens[i])
        torch.testing.assert_close(flat_logits(res, i), want, atol=1e-4, rtol=0)
