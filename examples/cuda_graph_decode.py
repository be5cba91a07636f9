"""Decode through CUDA graphs: ``DecodeGraphRunner`` captures the compiled decode step once per
batch size and replays it; prefill still runs through the compiled model.

On a CUDA GPU with FlashInfer it captures real graphs (FP8 global layers on XQA, bf16 sliding
layers); elsewhere it runs the runner's same fixed-buffer path without capturing
(``capture=False``, reference kernel), so the script runs anywhere.

    python examples/cuda_graph_decode.py
"""

from __future__ import annotations

import torch

from torch_kvq import KVCacheConfig, make_kvq_backend
from torch_kvq.attention.graph_runner import DecodeGraphRunner
from torch_kvq.models import build_model, generate

on_gpu = torch.cuda.is_available()
kv = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=16)
if on_gpu:
    from torch_kvq.attention.kernels import FlashInferKernel

    # FlashInfer serves head sizes 64 / 128 / 256: widen the tiny preset's heads
    kernel = FlashInferKernel(fp8_decode="xqa")
    model = build_model("gemma3-tiny", kv, device="cuda", kernel=kernel, head_dim=128)
    compiled = torch.compile(model, backend=make_kvq_backend())
else:
    model = build_model("gemma3-tiny", kv)  # reference kernel on the CPU
    compiled = torch.compile(model, backend=make_kvq_backend(inner="eager"))

# Graphs for batches of up to 4 sequences of up to 256 tokens; 3 prompts run padded in the 4-slot.
runner = DecodeGraphRunner(model, compiled, batch_sizes=(1, 2, 4), max_context=256, capture=on_gpu)
prompts = [[1, 5, 9, 14, 3, 7, 2], [8, 2, 4], [11] * 20]
graphed = generate(model, prompts, max_new_tokens=8, forward=compiled, decode=runner)
plain = generate(model, prompts, max_new_tokens=8, forward=compiled, force_tokens=graphed.tokens)

print(f"captured batch sizes: {runner.captured_sizes} (capture={runner.capture})")
print(f"scratch page for padding rows: {runner.scratch_page}")
for p, t in zip(prompts, graphed.tokens):
    print(f"  prompt of {len(p):2d} tokens -> {t}")
diff = (graphed.logits - plain.logits).abs().max().item()
print(f"max |logit difference| graph runner vs plain compiled steps: {diff:.2e}")
assert diff < (0.1 if on_gpu else 1e-2), diff
