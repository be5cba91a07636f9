"""``hf_model.generate(...)`` through the paged cache: HF's own generation loop, a placeholder
``KVQPagedCache`` and a forward that serves the left-padded ``[B, S]`` batch as one flat batch.

fp32, kv "auto": exactly HF eager's tokens on a left-padded batch; every page freed afterwards;
right padding, an HF cache alongside (a double write) and beam search are refused.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DynamicCache

from tests.support.hf_families import NUM_PAGES, PAGE_SIZE, VOCAB, make_prompts, twins
from torch_kvq import KVCacheConfig
from torch_kvq.integrations.transformers import KVQCausalLM

KW = dict(max_new_tokens=6, do_sample=False)


def left_padded(lens=(5, 19, 12)) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] ids (pad 0 on the left) and the 2D mask."""
    prompts = make_prompts(lens)
    s = max(lens)
    ids = torch.zeros(len(prompts), s, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, s - len(p) :] = torch.tensor(p)
        mask[i, s - len(p) :] = 1
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "gemma3", "mistral"])
def test_generate_equals_hf_eager_left_padded(family):
    hf, ref = twins(family)
    lm = KVQCausalLM.from_hf(hf, KVCacheConfig(page_size=PAGE_SIZE), num_pages=NUM_PAGES)
    ids, mask = left_padded()
    want = ref.generate(ids, attention_mask=mask, **KW)
    got = lm.generate(ids, attention_mask=mask, **KW)
    assert torch.equal(got, want)
    assert lm.allocator.sequences == ()
    # the same through hf_model.generate with the cache in hand
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with lm.paged_cache() as cache:  # transformers 5.x: cache=, 4.x: past_key_values=
        got = hf.generate(ids, attention_mask=mask, **{key: cache}, **KW)
        assert len(lm.allocator.sequences) == 3
    assert torch.equal(got, want)
    assert lm.allocator.sequences == ()
    # no padding at all: generate drops the all-ones mask
    full = ids[1:2]
    assert torch.equal(lm.generate(full, **KW), ref.generate(full, **KW))


def test_direct_call_with_the_cache_returns_padded_logits():
    """Without generate: the [B, S] call scatters the flat logits back; pads get zeros."""
    hf, ref = twins("qwen2")
    lm = KVQCausalLM.from_hf(hf, KVCacheConfig(page_size=PAGE_SIZE), num_pages=NUM_PAGES)
    ids, mask = left_padded()
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad(), lm.paged_cache() as cache:
        got = hf(ids, attention_mask=mask, use_cache=True, **{key: cache}).logits
        want = ref(ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        real = mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)
        assert not got[~real].any()
        step = torch.tensor([[7], [8], [9]])
        mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        got = hf(step, attention_mask=mask, use_cache=True, **{key: cache}).logits
    full = torch.cat([ids, step], 1)
    want = ref(full, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    torch.testing.assert_close(got[:, -1], want[:, -1], atol=1e-4, rtol=0)
    assert lm.allocator.sequences == ()


def test_generate_with_fp8_layers_stays_close():
    hf, ref = twins("gemma3")
    kv = KVCacheConfig(
        "fp8", skip_layers=("sliding_window",), page_size=PAGE_SIZE, default_k_scale=0.02,
        default_v_scale=0.02,
    )  # fmt: skip
    lm = KVQCausalLM.from_hf(hf, kv, num_pages=NUM_PAGES)
    ids, mask = left_padded()
    out = lm.generate(
        ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, **KW
    )
    want = ref.generate(
        ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, **KW
    )
    assert out.sequences.shape == want.sequences.shape
    assert (out.scores[0] - want.scores[0]).abs().max() < 0.3  # one FP8 step of the prefill
    assert lm.allocator.sequences == ()


def test_refused_generate_inputs_free_their_pages():
    hf, _ = twins("llama")
    lm = KVQCausalLM.from_hf(hf, KVCacheConfig(page_size=PAGE_SIZE), num_pages=NUM_PAGES)
    ids, mask = left_padded()
    with pytest.raises(ValueError, match="right padding"):
        lm.generate(ids, attention_mask=mask.flip(1), **KW)
    with pytest.raises(ValueError, match="beam search"):
        lm.generate(ids, attention_mask=mask, num_beams=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="double write"):
        hf.generate(ids, attention_mask=mask, **KW)  # HF's own DynamicCache
    with pytest.raises(ValueError, match="double write"):
        hf(ids, past_key_values=DynamicCache(config=hf.config), use_cache=True)
    assert lm.allocator.sequences == ()
    assert lm.generate(ids[:, -4:], **KW).shape == (3, 10)  # still serves afterwards


def test_detach_gives_the_model_back():
    hf, ref = twins("qwen2")
    lm = KVQCausalLM.from_hf(hf, KVCacheConfig(page_size=PAGE_SIZE), num_pages=NUM_PAGES)
    assert hf.config._attn_implementation == "kvq"
    hf = lm.detach()
    assert hf.config._attn_implementation == "eager"
    assert not any("kvq" in n for n, _ in hf.named_modules())
    ids = torch.randint(3, VOCAB, (1, 7))
    torch.testing.assert_close(hf(ids).logits, ref(ids).logits, rtol=0, atol=0)
    KVQCausalLM.from_hf(hf, KVCacheConfig(page_size=PAGE_SIZE), num_pages=NUM_PAGES)  # again
