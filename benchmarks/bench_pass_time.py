"""How long the kvq passes take, against layer count, and as a share of a whole compile.

1. Pass time vs layer count: the Gemma-style model (``gemma3-tiny`` with N layers, FP8 KV cache,
   sliding-window layers skipped) is captured once per N as the post-grad-shaped graph (AOT +
   Inductor decompositions, ``make_kvq_backend(inner="eager", passes=())``); then the pass
   manager runs on fresh copies of it, ``--repeat`` times, and the median is kept.
2. Share of compile time: at ``--share-layers`` layers, the first call of
   ``torch.compile(model, backend=kvq_backend)`` (Inductor, FX graph / AOT caches off) is timed
   and compared with the pass manager's own time for that graph.

    python benchmarks/bench_pass_time.py [--layers 8 16 32 64 128] [--share-layers 32] [--out FILE]

Prints a markdown table; ``--out`` also appends it to a file (e.g. benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import time

import torch
from torch import fx

from torch_kvq.models import build_model
from torch_kvq.passes import KVQPassManager, kvq_backend, make_kvq_backend
from torch_kvq.progress import Progress, activity
from torch_kvq.spec import KVCacheConfig

CFG = KVCacheConfig(kv_cache_dtype="fp8", skip_layers=("sliding_window",))
PROMPTS = [(0, 24), (1, 9)]  # (sequence id, prefill tokens)


def _model(layers: int):
    types = (["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6 + 1)
    return build_model(
        "gemma3-tiny", CFG, num_pages=16, num_hidden_layers=layers, layer_types=types[:layers]
    )


def _batch(model):
    md = model.allocator.build_batch(PROMPTS)
    ids = torch.randint(
        0, model.config.vocab_size, (md.num_tokens,), generator=torch.Generator().manual_seed(0)
    )
    return md, ids


def capture(layers: int) -> tuple[fx.GraphModule, KVQPassManager, torch.nn.Module]:
    """The pre-pass graph of an N-layer model, a manager for its layers, and the model (alive:
    the passes resolve layer names through the live-layer registry)."""
    torch._dynamo.reset()
    model = _model(layers)
    md, ids = _batch(model)
    backend = make_kvq_backend(inner="eager", passes=())
    with torch.no_grad(), model.forward_context(md):
        torch.compile(model, backend=backend, fullgraph=True)(ids, md.positions)
    return backend.graphs[-1], KVQPassManager(model.kv_specs), model


def pass_time(gm: fx.GraphModule, manager: KVQPassManager, repeat: int) -> tuple[float, int, dict]:
    times = []
    for _ in range(repeat):
        graph = copy.deepcopy(gm.graph)
        fx.GraphModule(gm, graph)  # owning module, as Inductor's graph has
        t0 = time.perf_counter()
        manager(graph)
        times.append(time.perf_counter() - t0)
    rep = manager.last
    per_pass = {name: s.time_s for name, s in rep.per_pass.items()}
    return statistics.median(times), len(gm.graph.nodes), per_pass


def compile_share(layers: int) -> tuple[float, float]:
    """(first-call compile wall time, pass manager time) with Inductor, caches off."""
    torch._dynamo.reset()
    model = _model(layers)
    md, ids = _batch(model)
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        with torch.no_grad(), model.forward_context(md):
            t0 = time.perf_counter()
            torch.compile(model, backend=kvq_backend, fullgraph=True)(ids, md.positions)
            total = time.perf_counter() - t0
    from torch_kvq.passes import last_report

    rep = last_report()
    assert rep is not None and rep.source == "passes"
    return total, rep.time_s


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--share-layers", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", help="append the results to this markdown file")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    rows = [
        "| layers | graph nodes | passes (median) ms | ms / layer | annotate | quant+write | dequant+attn | output quant | cleanup |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    bar = Progress("bench_pass_time", len(args.layers), unit="models")
    for n in args.layers:
        bar.update(status=f"{n} layers: capture, then the passes x {args.repeat}")
        gm, manager, _model_alive = capture(n)
        t, nodes, per = pass_time(gm, manager, args.repeat)
        cells = [f"{per[p] * 1e3:.1f}" for p in manager.pass_names]
        rows.append(
            f"| {n} | {nodes} | {t * 1e3:.1f} | {t * 1e3 / n:.2f} | " + " | ".join(cells) + " |"
        )
        bar.echo(rows[-1])
        bar.update(bar.done + 1)
    bar.close()
    with activity(f"first compile of a {args.share_layers}-layer model"):
        total, passes = compile_share(args.share_layers)
    share = (
        f"At {args.share_layers} layers, the first call of `torch.compile(model, backend=kvq_backend)` "
        f"took {total:.1f} s (Dynamo + AOT + passes + Inductor, caches off); the passes took "
        f"{passes * 1e3:.1f} ms = {100 * passes / total:.2f}% of it."
    )
    text = "\n".join(
        [
            "",
            "## CPU: pass time vs layer count",
            "",
            f"- date: {datetime.date.today().isoformat()}",
            f"- machine: {_cpu_name()}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} torch threads, {platform.platform()}",
            f"- torch {torch.__version__}, Python {platform.python_version()}",
            "- command: `python benchmarks/bench_pass_time.py "
            + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items()
                if k != "out" and v is not None
            )
            + "`",
            "- model: gemma3-tiny with N layers (5 sliding : 1 global), FP8 KV cache, sliding layers "
            "skipped; one prefill batch of 33 tokens",
            "",
            *rows,
            "",
            share,
            "",
        ]
    )
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
