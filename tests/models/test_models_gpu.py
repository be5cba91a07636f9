"""The models on a CUDA GPU: reference kernel against the CPU, FlashInfer against the reference.

Gemma-style mixed model (FP8 global layers, bf16 sliding layers), prompts longer than the window,
decode through the paged cache. Skips cleanly without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.hf_parity import check_fp8_caches, make_prompts, max_err
from torch_kvq import KVCacheConfig
from torch_kvq.models import build_model, generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = make_prompts((5, 40, 17))
MIXED = dict(kv_cache_dtype="fp8", skip_layers=("sliding_window",))


def test_cuda_reference_matches_cpu():
    kv = KVCacheConfig(**MIXED, page_size=4)
    cpu = build_model("gemma3-tiny", kv, num_pages=64)
    gpu = build_model("gemma3-tiny", kv, num_pages=64, device="cuda")
    ref = generate(cpu, PROMPTS, 6, prefill_logits=True)
    out = generate(gpu, PROMPTS, 6, force_tokens=ref.tokens, prefill_logits=True)
    assert out.logits.device.type == "cuda"
    assert all(a.kv_cache.device.type == "cuda" for a in gpu.attention_layers)
    check_fp8_caches(gpu, build_model("gemma3-tiny", KVCacheConfig(page_size=4), num_pages=64))
    # bf16 matmuls differ between CPU and GPU; logits reach |5|
    assert max_err(ref, _to_cpu(out)) <= 0.15


def test_flashinfer_serves_the_mixed_model():
    from torch_kvq.attention.kernels import FlashInferKernel
    from torch_kvq.attention.kernels.flashinfer_jit import prebuild

    kv = KVCacheConfig(**MIXED, page_size=16)
    head = dict(head_dim=128, query_pre_attn_scalar=128)  # FlashInfer head sizes: 64, 128, 256
    kernel = FlashInferKernel()
    fi = build_model("gemma3-tiny", kv, num_pages=64, device="cuda", kernel=kernel, **head)
    ref_model = build_model("gemma3-tiny", kv, num_pages=64, device="cuda", **head)
    prebuild(kernel, fi.kv_specs)
    ref = generate(ref_model, PROMPTS, 6, prefill_logits=True)
    out = generate(fi, PROMPTS, 6, force_tokens=ref.tokens, prefill_logits=True)
    err = max_err(_to_cpu(ref), _to_cpu(out))
    assert err <= 0.15, err


@pytest.mark.parametrize("fp8_decode", ["tensor_cores", "triton"])
def test_fused_projections_on_flashinfer_compiled(fp8_decode):
    """The at-scale benchmark's configuration: q/k/v and gate/up fused, kvq_backend, FlashInfer
    (FP8 decode on the tensor cores or our Triton kernel) computes what the unfused model does."""
    if fp8_decode == "triton":
        pytest.importorskip("triton")
    from torch_kvq import kvq_backend
    from torch_kvq.attention.kernels import FlashInferKernel
    from torch_kvq.attention.kernels.flashinfer_jit import prebuild

    kv = KVCacheConfig(**MIXED, page_size=16)
    head = dict(head_dim=128, query_pre_attn_scalar=128)
    models = []
    for fuse in (False, True):
        kernel = FlashInferKernel(fp8_decode=fp8_decode)
        m = build_model(
            "gemma3-tiny", kv, num_pages=64, device="cuda", kernel=kernel, seed=2, **head
        )
        prebuild(kernel, m.kv_specs)
        if fuse:
            m.fuse_projections()
        models.append(m)
    torch._dynamo.reset()
    try:
        ref = generate(
            models[0],
            PROMPTS,
            6,
            forward=torch.compile(models[0], backend=kvq_backend),
            prefill_logits=True,
        )
        out = generate(
            models[1], PROMPTS, 6, forward=torch.compile(models[1], backend=kvq_backend),
            force_tokens=ref.tokens,
         prefill_logits=True)  # fmt: skip
    finally:
        torch._dynamo.reset()
    assert models[1].projections_fused and not models[0].projections_fused
    err = max_err(_to_cpu(ref), _to_cpu(out))
    # bf16 GEMMs of another width round differently (then an FP8 cache entry may round the
    # other way); logits reach |5|, and a wrong split of the fused output is O(1)
    assert err <= 0.1, err


def _to_cpu(res):
    return type(res)(res.tokens, res.logits.cpu(), [p.cpu() for p in res.prefill_logits])
