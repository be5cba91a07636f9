"""Where the host time of a CUDA-graph decode step goes (cProfile over timed steps).

Builds the bench_model_decode model (BENCH_OVERRIDES), kvq_backend + ``DecodeGraphRunner``, FP8
via XQA, and profiles ``steps`` decode steps on the host: the functions with the most
cumulative and own time, and the wall time per step with and without the profiler.

    python benchmarks/profile_graph_step.py --batch 32 --ctx 16384
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model_decode import build, fill_caches  # noqa: E402
from gpu_common import environment, write_results  # noqa: E402

import torch_kvq  # noqa: E402
from torch_kvq.attention.graph_runner import DecodeGraphRunner  # noqa: E402
from torch_kvq.attention.kernels import FlashInferKernel  # noqa: E402
from torch_kvq.spec import KVCacheConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--fp8-decode", choices=["tensor_cores", "xqa"], default="xqa")
    args = ap.parse_args()
    kv = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=16)
    kernel = FlashInferKernel(fp8_decode=args.fp8_decode, phases="decode", unfused_attention=False)
    pages = args.batch * (-(-(args.ctx + 2 * args.steps + 16) // 16)) + 16
    model = build("gemma3-tiny", kv, kernel, pages, "cuda", tiny=False)
    fill_caches(model)
    compiled = torch.compile(model, backend=torch_kvq.kvq_backend)
    runner = DecodeGraphRunner(
        model, compiled, batch_sizes=(args.batch,), max_context=args.ctx + 2 * args.steps + 16
    )
    alloc, vocab = model.allocator, model.config.vocab_size
    for i in range(args.batch):
        alloc.append(i, args.ctx - 1)

    def step() -> torch.Tensor:
        ids = torch.randint(0, vocab, (args.batch,), device="cuda")
        return runner(ids, alloc.build_batch([(i, 1) for i in range(args.batch)], device="cpu"))

    with torch.no_grad():
        for _ in range(3):  # capture
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps // 2):
            step()
        torch.cuda.synchronize()
        plain_ms = (time.perf_counter() - t0) * 1e3 / (args.steps // 2)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
        torch.cuda.synchronize()
        prof_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    text = []
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
        text.append(buf.getvalue())
    md = (
        f"## Host profile of a CUDA-graph decode step\n\n{environment()}\n\n"
        f"{args.batch} x {args.ctx}, FP8 decode {args.fp8_decode}: {plain_ms:.3f} ms/step, "
        f"{prof_ms:.3f} ms/step under cProfile\n\n```\n" + "\n".join(text) + "```\n"
    )
    write_results("profile_graph_step", {"args": vars(args), "plain_ms": plain_ms,
                                         "profiled_ms": prof_ms, "stats": text}, md)  # fmt: skip


if __name__ == "__main__":
    main()
