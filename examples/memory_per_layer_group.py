"""Memory that follows the per-layer spec: windowed page pools on a Gemma-3-style model.

1. A Gemma-3-12B-shaped model built on the meta device (no memory): the KV bytes at 32 x 16k with
   one shared page table, with windowed pools, and the ideal (global x context + sliding x window).
2. A tiny Gemma-3-style model on the CPU with windowed pools: the sliding layers' caches hold the
   window, pages outside it go back to their pool during generation, and the tokens equal those
   of the same model on one shared table.

    python examples/memory_per_layer_group.py
"""

from __future__ import annotations

import torch

from torch_kvq import KVCacheConfig
from torch_kvq.attention.memory import ideal_kv_bytes, plan_kv_memory
from torch_kvq.models import build_model, generate
from torch_kvq.models.gemma3 import Gemma3Model
from torch_kvq.models.presets import tiny_gemma3_config

GIB = 2**30
GEMMA3_12B = dict(
    vocab_size=262144, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
    sliding_window=1024, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8,
)  # fmt: skip


def big_model_bytes() -> None:
    print("Gemma-3-12B shape, 32 sequences x 16384 tokens, page 16 (built on the meta device):")
    for label, kv in (
        ("all-bf16", KVCacheConfig("auto", page_size=16)),
        ("FP8 global, sliding bf16", KVCacheConfig("fp8", skip_layers=("sliding_window",))),
    ):
        specs = Gemma3Model(tiny_gemma3_config(**GEMMA3_12B), kv, 1, device="meta").kv_specs
        shared = plan_kv_memory(specs, 32, 16384, windowed=False)
        pooled = plan_kv_memory(specs, 32, 16384, prefill_chunk=1024)
        ideal = ideal_kv_bytes(specs, 32, 16384)
        print(f"  {label:26s} shared table {shared.bytes / GIB:6.1f} GiB, windowed pools "
              f"{pooled.bytes / GIB:5.1f} GiB (window pool {pooled.window_pages} pages), "
              f"ideal {ideal / GIB:5.1f} GiB")  # fmt: skip


def tiny_model_generation() -> None:
    kv = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [7, 8] * 10]  # longer than the window of 8
    shared = build_model("gemma3-tiny", kv, num_pages=64, dtype=torch.float32)
    pooled = build_model("gemma3-tiny", kv, num_pages=64, window_pages=16, dtype=torch.float32)
    caches = {
        a.layer_name.split(".", 1)[1]: tuple(a.kv_cache.shape) for a in pooled.attention_layers
    }
    print("tiny Gemma-3-style model, window 8, page 4, windowed pool of 16 pages:")
    for name, shape in caches.items():
        print(f"  {name}: cache {shape}")
    want = generate(shared, prompts, max_new_tokens=12)
    got = generate(pooled, prompts, max_new_tokens=12)
    assert got.tokens == want.tokens, (got.tokens, want.tokens)
    print(f"  same {sum(len(t) for t in got.tokens)} tokens as on one shared table; "
          f"window pool free again: {pooled.allocator.free_pages(8)} of 16 pages")  # fmt: skip


if __name__ == "__main__":
    big_model_bytes()
    tiny_model_generation()
