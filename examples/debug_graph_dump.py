"""Dump the kvq passes' work from user code, then explain why each layer was or was not fused.

    python examples/debug_graph_dump.py [OUT_DIR]

Compiles a small Llama-style model (FP8 KV cache; layer 0 kept in bf16 by a skip rule) with
``make_kvq_backend(dump_dir=...)`` and reads the pass manager's report back from Python.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from torch_kvq import KVCacheConfig, make_kvq_backend
from torch_kvq.models import build_model, generate
from torch_kvq.passes import last_report

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="kvq_dump_"))
model = build_model("llama-tiny", KVCacheConfig("fp8", skip_layers=(0,)))
backend = make_kvq_backend(inner="eager", dump_dir=out)  # inner="inductor" for the real compile
compiled = torch.compile(model, backend=backend)
generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=1, forward=compiled)

report = last_report()
assert report is not None, "the passes did not run"
print(report.summary())
print()
for layer, decisions in report.per_layer.items():
    fused = report.fused(layer)
    if fused:
        print(f"{layer}: fused {', '.join(fused)}")
    for pass_name, decision in decisions.items():
        if not decision.startswith("fused") and pass_name != "annotate":
            print(f"{layer}: {pass_name} -> {decision}")
print()
graph = Path(report.dump_dir)
print(f"dumps of this graph in {graph}:")
for f in sorted(graph.iterdir()):
    print(f"  {f.name}")
print()
print("what fuse_dequant_attention changed:")
print((graph / "fuse_dequant_attention.diff").read_text()[:1500])
