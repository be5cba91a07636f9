"""Issue 32 on Hugging Face models: ``KVQCausalLM`` gets the per-layer modes through ``PagedKV``
(a per-(token, head) layer has its ``kv_scale``), compiled with the passes equals eager bit for
bit, and checkpoint FP8 scales load for the per-tensor layers only."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf_families import NUM_PAGES, PAGE_SIZE, hf_model, make_prompts
from tests.support.passes import no_compile_caches
from torch_kvq import KVCacheConfig
from torch_kvq.integrations.transformers import KVQCausalLM
from torch_kvq.models import generate
from torch_kvq.passes import make_kvq_backend

MAP = ((0, "fp8"), (1, "int8_per_token_head"), (-1, "fp8_per_token_head"))


def _compiled_equals_eager(lm):
    """Greedy generation eagerly, then compiled with the kvq passes (the eager tokens forced): the
    logits and prefill logits equal bit for bit. Returns the passes' last report."""
    prompts = make_prompts()
    eager = generate(lm, prompts, 3, prefill_logits=True)
    backend = make_kvq_backend(inner="eager")
    with no_compile_caches():
        comp = generate(
            lm,
            prompts,
            3,
            forward=lm.compiled_forward(backend),
            force_tokens=eager.tokens,
            prefill_logits=True,
        )
    torch._dynamo.reset()
    assert torch.equal(comp.logits, eager.logits)
    for c, e in zip(comp.prefill_logits, eager.prefill_logits):
        assert torch.equal(c, e)
    return backend.managers[-1].last


def test_hf_model_with_three_modes_compiles_to_eager():
    lm = KVQCausalLM.from_hf(
        hf_model("llama", torch.bfloat16),
        KVCacheConfig("auto", layer_modes=MAP, page_size=PAGE_SIZE),
        num_pages=NUM_PAGES,
    )
    assert [s.mode.value for s in lm.kv_specs] == [
        "fp8_per_tensor", "int8_per_token_head", "none", "fp8_per_token_head"
    ]  # fmt: skip
    assert [a.kv_scale is not None for a in lm.attention_layers] == [False, True, False, True]
    rep = _compiled_equals_eager(lm)
    quantized = {s.name for s in lm.kv_specs if s.is_quantized}
    assert (
        set(rep.layers_fused("quant+write")) == set(rep.layers_fused("dequant+attn")) == quantized
    )
    assert rep.ops_after["kvq.paged_attention_per_token_head"] == 2
    lm.detach()


def test_hf_model_with_an_int4_layer_compiles_to_eager():
    """int4_per_token_head (issue 33) next to int8 and bf16 layers on a Hugging Face model: each
    layer's cache its own (int4: uint8, D / 2), compiled with the passes equals eager bit for bit
    (reference kernel)."""
    lm = KVQCausalLM.from_hf(
        hf_model("llama", torch.bfloat16),
        KVCacheConfig(
            "auto",
            layer_modes=((0, "int4_per_token_head"), (1, "int8_per_token_head")),
            page_size=PAGE_SIZE,
        ),
        num_pages=NUM_PAGES,
    )
    caches = [(a.kv_cache.dtype, a.kv_cache.shape[-1]) for a in lm.attention_layers]
    d = lm.kv_specs[0].head_size
    assert caches == [
        (torch.uint8, d // 2),
        (torch.int8, d),
        (torch.bfloat16, d),
        (torch.bfloat16, d),
    ]
    prompts = make_prompts()
    eager = generate(lm, prompts, 3, prefill_logits=True)
    backend = make_kvq_backend(inner="eager")
    with no_compile_caches():
        comp = generate(
            lm,
            prompts,
            3,
            forward=lm.compiled_forward(backend),
            force_tokens=eager.tokens,
            prefill_logits=True,
        )
    torch._dynamo.reset()
    assert torch.equal(comp.logits, eager.logits)
    rep = backend.managers[-1].last
    assert set(rep.layers_fused("quant+write")) == {s.name for s in lm.kv_specs[:2]}
    lm.detach()


def test_hf_model_with_a_k8v4_layer_compiles_to_eager():
    """k8v4_per_token_head (k int8, v int4) next to int4 and int8 layers on a Hugging Face model:
    its cache uint8 [pages, 3, page, KH, D / 2]; compiled with the passes equals eager bit for bit
    and every quantized layer's write and read are fused (reference kernel)."""
    lm = KVQCausalLM.from_hf(
        hf_model("llama", torch.bfloat16),
        KVCacheConfig(
            "auto",
            layer_modes=(
                (0, "k8v4_per_token_head"),
                (1, "int4_per_token_head"),
                (2, "int8_per_token_head"),
            ),
            page_size=PAGE_SIZE,
        ),
        num_pages=NUM_PAGES,
    )
    caches = [
        (a.kv_cache.dtype, tuple(a.kv_cache.shape[1:2]) + a.kv_cache.shape[-1:])
        for a in lm.attention_layers
    ]
    d = lm.kv_specs[0].head_size
    assert caches == [
        (torch.uint8, (3, d // 2)),
        (torch.uint8, (2, d // 2)),
        (torch.int8, (2, d)),
        (torch.bfloat16, (2, d)),
    ]
    rep = _compiled_equals_eager(lm)
    quantized = {s.name for s in lm.kv_specs[:3]}
    assert (
        set(rep.layers_fused("quant+write")) == set(rep.layers_fused("dequant+attn")) == quantized
    )
    lm.detach()


def test_checkpoint_scales_load_for_the_per_tensor_layers_only():
    scales = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.5) for i in range(4)}
    lm = KVQCausalLM.from_hf(
        hf_model("llama", torch.bfloat16),
        KVCacheConfig("fp8", layer_modes=((1, "int8_per_token_head"),), page_size=PAGE_SIZE),
        num_pages=NUM_PAGES,
        kv_scales_from=scales,
    )
    pairs = [(s.mode.value, s.k_scale, s.v_scale) for s in lm.kv_specs]
    assert pairs[1] == ("int8_per_token_head", 1.0, 1.0)  # computes its own scales
    assert [p for i, p in enumerate(pairs) if i != 1] == [("fp8_per_tensor", 0.5, 0.5)] * 3
    lm.detach()
    with pytest.raises(ValueError, match="kv_scales gives per-tensor scales for layer"):
        KVQCausalLM.from_hf(
            hf_model("llama", torch.bfloat16),
            KVCacheConfig("int8_per_token_head", kv_scales={0: (0.5, 0.5)}),
            num_pages=NUM_PAGES,
        )


def test_hf_model_with_a_calibrated_tc4_layer_compiles_to_eager():
    """tc4_per_token_head next to an int4 layer on a Hugging Face model: its K basis calibrated
    on the model's own q and k (``calibrate.k_bases``), given per HF path (``with_k_bases``);
    compiled with the passes equals eager bit for bit, both layers' writes and reads fused."""
    from torch_kvq.evaluation.calibrate import k_bases

    lm = KVQCausalLM.from_hf(
        hf_model("llama", torch.bfloat16), KVCacheConfig(page_size=PAGE_SIZE), num_pages=NUM_PAGES
    )
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, lm.config.vocab_size, (2, 24), generator=g).tolist()
    table = k_bases(lm, windows)
    assert sorted(table) == sorted(lm.layer_paths.values())
    modes = ((0, "tc4_per_token_head"), (1, "int4_per_token_head"))
    cfg = lm.with_k_bases(KVCacheConfig("auto", layer_modes=modes, page_size=PAGE_SIZE), table)
    assert [p for p, _ in cfg.k_bases] == [lm.layer_paths[lm.kv_specs[0].name]]
    lm.configure_kv(cfg)
    tc4 = lm.attention_layers[0]
    assert tc4.kv_scale.dtype == torch.uint8 and tc4.k_basis is not None
    rep = _compiled_equals_eager(lm)
    quantized = {s.name for s in lm.kv_specs[:2]}
    assert (
        set(rep.layers_fused("quant+write")) == set(rep.layers_fused("dequant+attn")) == quantized
    )
    assert rep.ops_after["kvq.paged_attention_tc"] == 1
    with pytest.raises(ValueError, match="no layer of this KV config is tc4_per_token_head"):
        lm.with_k_bases(KVCacheConfig("fp8"), table)
    lm.detach()


def test_k_channels_and_bases_attach_in_either_order_on_a_map_with_both():
    """A map with an int4 layer and a tc4 layer (issue 33's hybrid maps, ``kvq eval``'s
    ``channels=calibrate:basis=calibrate``): the K channel scales go to the int4 layer and the K
    basis to the tc4 one whichever is attached first (``with_k_channels`` once resolved the
    whole config, which refused the tc4 layer still without its basis)."""
    from torch_kvq.evaluation.calibrate import k_bases, k_channel_scales

    lm = KVQCausalLM.from_hf(
        hf_model("llama", torch.bfloat16), KVCacheConfig(page_size=PAGE_SIZE), num_pages=NUM_PAGES
    )
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, lm.config.vocab_size, (2, 24), generator=g).tolist()
    bases, channels = k_bases(lm, windows), k_channel_scales(lm, windows)
    modes = ((0, "tc4_per_token_head"), (1, "int4_per_token_head"))
    cfg = KVCacheConfig("auto", layer_modes=modes, page_size=PAGE_SIZE)
    paths = [lm.layer_paths[s.name] for s in lm.kv_specs[:2]]
    for both in (
        lm.with_k_bases(lm.with_k_channels(cfg, channels), bases),
        lm.with_k_channels(lm.with_k_bases(cfg, bases), channels),
    ):
        assert [p for p, _ in both.k_bases] == paths[:1]
        assert [p for p, _ in both.k_channel_scales] == paths[1:]
        lm.configure_kv(both)
        tc4, int4 = lm.kv_specs[:2]
        assert tc4.k_basis is not None and tc4.k_channel is None
        assert int4.k_channel is not None and int4.k_basis is None
    lm.detach()
