"""Host time of a decode step's batch on the CPU: ``PageAllocator.build_batch`` + the graph
runner's checks + its fill of the fixed buffers (what ``DecodeGraphRunner`` does before plan and
replay), per step over ``--steps`` steps of ``--batch`` sequences at ``--ctx`` tokens.

Sequences of equal length cross a page boundary on the same step (every ``page_size`` steps); the
max shows those steps. No GPU, no model run (a 2-layer toy model only supplies the caches).

    python benchmarks/bench_host_batch.py --batch 64 --ctx 16384 --steps 128
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from torch_kvq import KVCacheConfig
from torch_kvq.attention.graph_runner import DecodeGraphRunner, _Slot
from torch_kvq.attention.metadata import GraphShape
from torch_kvq.models import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    b, ctx, page = args.batch, args.ctx, args.page_size
    kv = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=page)
    pages = b * (-(-(ctx + args.steps) // page) + 1) + 16
    model = build_model(
        "gemma3-tiny", kv, num_pages=pages, dtype=torch.float32, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    limit = ctx + args.steps + 1
    runner = DecodeGraphRunner(model, batch_sizes=(b,), max_context=limit, capture=False)
    slot = _Slot(GraphShape(b, -(-limit // page)), page, torch.device("cpu"))
    for i in range(b):
        model.allocator.append(i, ctx - 1)
    ids = torch.zeros(b, dtype=torch.long)
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        md = model.allocator.build_batch([(i, 1) for i in range(b)], device="cpu")
        runner._check(ids, md)
        slot.fill(md, ids, runner.scratch_pages)
        times.append((time.perf_counter() - t0) * 1e3)
    times = times[1:]  # the first step warms up (its sequences reach ctx tokens)
    # step i (from 1) brings the sequences to ctx + i tokens: a new page when that token opens one
    boundary = [t for i, t in enumerate(times, start=1) if (ctx + i - 1) % page == 0]
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    print(
        f"{b} x {ctx}, {args.steps} steps, page {page}: mean {statistics.mean(times):.3f} ms, "
        f"median {statistics.median(times):.3f} ms, max {max(times):.3f} ms; "
        f"page-boundary steps ({len(boundary)}): mean {statistics.mean(boundary):.3f} ms"
    )


if __name__ == "__main__":
    main()
