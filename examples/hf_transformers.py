"""Bring your own model: an unmodified Hugging Face transformers model (a tiny random-weight
Gemma 3 built from a config: sliding-window and global layers) on the per-layer paged KV
cache: FP8 for the full-attention layers, bf16 for the sliding ones, compiled with the kvq
passes, then HF's own ``generate`` through the same cache.

    python examples/hf_transformers.py              # passes + eager FX graph (seconds)
    python examples/hf_transformers.py --inductor   # passes + Inductor (about a minute on CPU)

With a real checkpoint: ``hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)``
and ``KVQCausalLM.from_hf(hf, kv, num_pages=..., kv_scales_from=path)`` for FP8-KV scales.
"""

from __future__ import annotations

import sys

import torch
import transformers

from torch_kvq import KVCacheConfig, format_spec_table
from torch_kvq.attention import calibrate_kv_scales
from torch_kvq.integrations.transformers import KVQCausalLM
from torch_kvq.models import generate, randomize_weights_
from torch_kvq.passes import last_report, make_kvq_backend

torch.manual_seed(0)
config = transformers.Gemma3TextConfig(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
    sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0,
)  # fmt: skip
hf = transformers.Gemma3ForCausalLM(config).to(torch.bfloat16).eval()
randomize_weights_(hf, 0, norm_offset=True)  # Gemma's norms scale by 1 + w
prompts = [[5, 17, 99, 3, 42, 7, 250, 11, 64, 8, 9, 31], [8, 2, 4]]

# 1. Attach with a bf16 cache and calibrate static k/v scales (amax / 448 per layer).
lm = KVQCausalLM.from_hf(hf, KVCacheConfig(page_size=4), num_pages=64)
scales = calibrate_kv_scales(lm, lambda: generate(lm, prompts, max_new_tokens=2))

# 2. FP8 everywhere except the sliding-window layers; names are the HF module paths.
lm.configure_kv(
    KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=4, kv_scales=scales)
)
print(format_spec_table(lm.kv_specs))
print()

# 3. Compile the whole HF model with the kvq passes (fullgraph: no graph breaks).
backend = make_kvq_backend(inner="inductor" if "--inductor" in sys.argv else "eager")
compiled = torch.compile(lm, backend=backend, fullgraph=True)
out = generate(lm, prompts, max_new_tokens=6, forward=compiled)
# the unfused form along the same tokens (in bf16 the two may break near-ties differently)
eager = generate(lm, prompts, max_new_tokens=6, force_tokens=out.tokens)
print(last_report().format())
print()
diff = (out.logits - eager.logits).abs().max().item()
print(f"compiled tokens: {out.tokens}")
print(f"compiled vs eager logits: max |diff| = {diff:.4f} of {eager.logits.abs().max():.2f}")

# 4. HF's own generate through the same paged cache (left-padded batch; pages freed after).
ids = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 2, 4], prompts[0]])
mask = (torch.arange(12) >= torch.tensor([[9], [0]])).long()
seqs = lm.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
ours = generate(lm, [prompts[1], prompts[0]], max_new_tokens=6).tokens  # our eager greedy loop
print(f"hf generate: {seqs[:, 12:].tolist()}  (pages in use afterwards: {lm.allocator.sequences})")
assert seqs[:, 12:].tolist() == ours, "HF generate and torch_kvq's generate disagree"
