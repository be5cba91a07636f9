"""Tensor parallelism on 2 GPUs (NCCL) with FlashInfer: compiled with the kvq passes == eager.

Launches ``tp_worker.py gpu`` (FP8 per tensor) and ``gpu4`` (issue 33's int4 and k8v4 layers
beside bf16 ones) on 2 ranks; skips cleanly with fewer than 2 GPUs. Tolerance: the compiled step
reads the cache in place (FP8: fp32 dequant in the kernel; 4-bit: the codes in fp16 products,
about 2e-3 relative per layer against fp32) where eager dequantizes to bf16 first, and Inductor
changes bf16 rounding elsewhere: 0.06 x max |logit|, as tests/passes/test_mixed_model.py measured
for this model on one GPU with FP8.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.launch import launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
    ),
]


@pytest.mark.parametrize("scenario", ["gpu", "gpu4"], ids=["fp8", "four_bit"])
def test_tp2_flashinfer_compiled_matches_eager(tmp_path, scenario: str):
    """``gpu``: FP8 per tensor on the global layers; ``gpu4``: int4 per (token, head) on them and
    k8v4 on sliding layer 0 (issue 33), each rank holding its one kv head."""
    r0, r1 = launch(scenario, tmp_path, timeout=600)
    for res in (r0, r1):
        assert res["compiled_tokens"] == res["eager_tokens"]
        assert res["max_diff"] <= 0.06 * res["scale"], (res["max_diff"], res["scale"])
        assert res["local_kv_heads"] == 1  # gemma3-tiny: 2 KV heads over 2 ranks
        assert res["report"]["quant+write"] == res["report"]["dequant+attn"] == res["quantized"]
    assert r0["report"] == r1["report"] and r0["eager_tokens"] == r1["eager_tokens"]
