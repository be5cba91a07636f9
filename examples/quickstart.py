"""Quickstart: a Gemma-style model with an FP8 KV cache whose sliding-window layers stay in bf16,
compiled with ``kvq_backend``; prints the per-layer plan and what the passes fused.

    python examples/quickstart.py
"""

from __future__ import annotations

import torch

from torch_kvq import KVCacheConfig, format_spec_table, kvq_backend
from torch_kvq.attention import calibrate_kv_scales
from torch_kvq.models import build_model, generate
from torch_kvq.passes import last_report
from torch_kvq.progress import activity  # a ticking line on stderr while a long step runs

prompts = [[1, 5, 9, 14, 3, 7, 2], [8, 2, 4]]

# 1. Calibrate static k/v scales on the bf16 model (amax / 448 per layer).
model = build_model("gemma3-tiny", KVCacheConfig())
with activity("calibrating k/v scales (bf16 model, eager)"):
    scales = calibrate_kv_scales(model, lambda: generate(model, prompts, max_new_tokens=2))

# 2. FP8 KV cache everywhere except the sliding-window layers, which keep their bf16 cache.
model.configure_kv(KVCacheConfig("fp8", skip_layers=("sliding_window",), kv_scales=scales))
print(format_spec_table(model.kv_specs))
print()

# 3. Compile with the kvq passes (Inductor underneath); dynamic=True: one graph serves the prefill
#    and the decode steps. generate: one mixed prefill batch, then decode steps.
#    The first call compiles (about a minute on 2 CPU cores); the line on stderr says so.
compiled = torch.compile(model, backend=kvq_backend, dynamic=True)
with activity("generating with the compiled model (the first call compiles)"):
    out = generate(model, prompts, max_new_tokens=4, forward=compiled)
with activity("generating eagerly (the unfused reference form)"):
    eager = generate(model, prompts, max_new_tokens=4, force_tokens=out.tokens)

# 4. What was fused, per layer (the report of the last compiled graph).
report = last_report()
fused = {name: ", ".join(report.fused(name)) or "-" for name in report.layers}
print(format_spec_table(model.kv_specs, extra={n: {"fused": f} for n, f in fused.items()}))
print()
print(report.format())
print()
diff = (out.logits - eager.logits).abs().max().item()
print(f"tokens: {out.tokens}")
print(
    f"compiled vs eager (unfused) logits: max |diff| = {diff:.4f} of max |logit| {eager.logits.abs().max().item():.2f}"
)
assert out.tokens == eager.logits.argmax(-1).tolist(), "compiled and eager chose different tokens"
