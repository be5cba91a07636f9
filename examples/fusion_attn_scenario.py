"""vLLM's test_fusion_attn.py scenario as a script: one attention layer with an FP8 KV cache,
its output reshaped for o_proj and statically quantized to FP8, compiled with ``kvq_backend``.

The passes turn quantize-k/v + cache write into one quantizing write, dequantize-whole-cache +
attention into attention that reads the FP8 cache in place, and attention + output quant into
attention that writes FP8 output (``output_scale``), since the reference kernel writes FP8
output (see torch_kvq/attention/kernels/capabilities.py). Prints the ops before and after.

    python examples/fusion_attn_scenario.py
"""

from __future__ import annotations

import torch

from torch_kvq import (
    Attention,
    AttentionLayerInfo,
    KVCacheConfig,
    PageAllocator,
    forward_context,
    kvq_backend,
    resolve_layer_specs,
)
from torch_kvq.attention import ReferenceKernel
from torch_kvq.passes import last_report

T_PREFILL, T_CONTEXT, HEADS, KV_HEADS, HEAD_SIZE = 24, 40, 32, 8, 128
OUT_SCALE = 0.01  # static scale of the o_proj input


class AttentionThenQuant(torch.nn.Module):
    def __init__(self, attn: Attention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, q, k, v):
        out = self.attn(q, k, v)  # [T, QH, D] bf16
        out = out.reshape(out.shape[0], -1)  # o_proj input [T, QH * D]
        return (out.float() / OUT_SCALE).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


info = AttentionLayerInfo("scenario.attn", HEADS, KV_HEADS, HEAD_SIZE)
(spec,) = resolve_layer_specs(
    KVCacheConfig("fp8", default_k_scale=4 / 448, default_v_scale=4 / 448), [info], torch.bfloat16
)
model = AttentionThenQuant(Attention(spec, num_pages=16, quant_form="torch"))

# A batch of one prefill sequence and two decode sequences with some context already cached.
alloc = PageAllocator(num_pages=16, page_size=spec.page_size)
alloc.append_many([(1, T_CONTEXT), (2, T_CONTEXT // 2)])
md = alloc.build_batch([(0, T_PREFILL), (1, 1), (2, 1)])
g = torch.Generator().manual_seed(0)
q = torch.randn(md.num_tokens, HEADS, HEAD_SIZE, generator=g).bfloat16()
k = torch.randn(md.num_tokens, KV_HEADS, HEAD_SIZE, generator=g).bfloat16()
v = torch.randn(md.num_tokens, KV_HEADS, HEAD_SIZE, generator=g).bfloat16()
history = (torch.randn(model.attn.kv_cache.shape, generator=g) * 448 / 4).clamp(-448, 448)
model.attn.kv_cache.copy_(history.to(torch.float8_e4m3fn))

with torch.no_grad(), forward_context(md, [spec], ReferenceKernel()):
    saved = model.attn.kv_cache.clone()
    eager = model(q, k, v)
    model.attn.kv_cache.copy_(saved)
    compiled = torch.compile(model, backend=kvq_backend, fullgraph=True)(q, k, v)

report = last_report()
print(report.format())  # per-layer decisions, per-pass matches and times, ops before / after
print()
print(f"fused: {', '.join(report.fused(spec.name))}")
diff = (compiled.float() - eager.float()).abs()
print(
    f"compiled vs eager FP8 output: {(diff > 0).float().mean().item():.1%} of values differ, max |diff| {diff.max().item():.3g}"
)
assert (
    report.ops_after.get("output_scale") == 1 and "kvq.dequantize_kv_cache" not in report.ops_after
)
