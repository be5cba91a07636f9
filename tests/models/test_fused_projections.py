"""``fuse_projections``: q/k/v in one GEMM and gate/up in one give the same model, and the kvq
passes still fuse every quantized layer's quant + write when k and v are views of one output."""

from __future__ import annotations

import pytest
import torch

from torch_kvq import KVCacheConfig
from torch_kvq.models import build_model, generate
from torch_kvq.passes import make_kvq_backend

PROMPTS = [[1, 2, 3, 4, 5], [7] * 11, [9, 8]]
FP8 = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=4)


@pytest.mark.parametrize("preset", ["gemma3-tiny", "llama-tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_model_computes_what_the_unfused_one_does(preset, dtype) -> None:
    plain = build_model(preset, FP8, seed=3, dtype=dtype)
    fused = build_model(preset, FP8, seed=3, dtype=dtype)
    fused.fuse_projections()
    attn, mlp = fused.layers[1].self_attn, fused.layers[1].mlp
    assert attn.q_proj is None and mlp.gate_proj is None and attn.qkv_proj is not None
    ref = plain.layers[1].self_attn
    assert torch.equal(
        attn.qkv_proj.weight, torch.cat([ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight])
    )
    a, b = generate(plain, PROMPTS, 4), generate(fused, PROMPTS, 4)
    # the same dot products; a GEMM's blocking may differ with its width, so allow rounding
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(b.logits, a.logits, rtol=tol, atol=tol)
    assert b.tokens == a.tokens
    for x, y in zip(plain.attention_layers, fused.attention_layers):  # caches written alike
        torch.testing.assert_close(y.kv_cache.float(), x.kv_cache.float(), rtol=tol, atol=tol)


def test_fuse_is_idempotent_and_loading_after_it_is_refused() -> None:
    m = build_model("llama-tiny", FP8)
    m.fuse_projections()
    w = m.layers[0].self_attn.qkv_proj.weight
    m.fuse_projections()
    assert m.layers[0].self_attn.qkv_proj.weight is w and m.projections_fused
    with pytest.raises(ValueError, match="projections are fused"):
        m.load_hf_state_dict({})


def test_passes_fuse_quantized_layers_of_a_fused_model() -> None:
    model = build_model("gemma3-tiny", FP8, seed=1)
    model.fuse_projections()
    eager = generate(model, PROMPTS, 3)
    backend = make_kvq_backend(inner="eager")
    torch._dynamo.reset()
    try:
        compiled = generate(
            model,
            PROMPTS,
            3,
            forward=torch.compile(model, backend=backend),
            force_tokens=eager.tokens,
        )
    finally:
        torch._dynamo.reset()
    quantized = {s.name for s in model.kv_specs if s.is_quantized}
    assert len(quantized) == 2
    for manager in backend.managers:
        assert set(manager.last.layers_fused("quant+write")) == quantized
        assert set(manager.last.layers_fused("dequant+attn")) == quantized
    assert compiled.tokens == eager.tokens
    torch.testing.assert_close(compiled.logits, eager.logits, rtol=0.02, atol=0.02)
