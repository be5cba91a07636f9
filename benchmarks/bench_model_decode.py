"""Model decode step on the GPU: kvq_backend (with and without CUDA graphs) vs eager unfused vs
plain torch.compile vs all-bf16.

The Gemma-style mixed model (sliding layers skipped -> bf16, global layers FP8), batch B at
context C: caches are filled with random values and pages reserved (no prefill needed: a decode
step costs the same whatever the cache holds), then timed decode steps, each = build the batch,
enter ``model.forward_context`` (plans), run the model. tokens/s = B / step time. ``host_ms`` is
the time for the host to return from a step without waiting for the GPU: when it is close to the
step time, the step is launch-bound. "+ CUDA graphs" variants run each step through
``DecodeGraphRunner`` (one graph captured for the batch size, then plan + replay per step).
With ``--profile-steps`` (default 3) each row also gets its GPU kernel time per step split by
kind (``kernel_kind``: FP8-KV attention, bf16-KV attention, GEMM, our cache writes, other) and
the top 30 kernels; when both "+ CUDA graphs" rows of FP8/XQA and all-bf16 ran,
``kernel_time_bound`` gives their kernel-time ratio and the ratio with the GEMMs at copy
bandwidth and the other kernels free.
Each variant runs ``--warmup`` untimed steps first (default 10) and records its 5 slowest steps.
``--fuse-projections`` runs every variant on ``model.fuse_projections()`` (q/k/v and gate/up as
one GEMM each).

Uses ``torch_kvq.models.build_model`` ("gemma3-tiny" with the size overrides below),
``model(input_ids, positions)``, ``model.forward_context(metadata)``, ``model.allocator`` and
``torch_kvq.kvq_backend``.

    python benchmarks/bench_model_decode.py --batch 32 --ctx 16384
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

# Inductor compiles in-process: its pool of compile workers (one Python + torch import per core)
# otherwise boots in the background while the first variant is timed, and steals its host CPU
# (seen on the H200, 2026-11-29: the first variant's host time per step 2.5 -> 6 ms).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import copy_bandwidth, environment, write_results  # noqa: E402

import torch_kvq  # noqa: E402
from torch_kvq.attention import Attention  # noqa: E402
from torch_kvq.attention.graph_runner import DecodeGraphRunner  # noqa: E402
from torch_kvq.attention.kernels import FlashInferKernel, ReferenceKernel  # noqa: E402
from torch_kvq.progress import Progress  # noqa: E402
from torch_kvq.spec import KVCacheConfig  # noqa: E402

# Gemma-2/3-like at a realistic attention size: 8 layers alternating sliding (window 4096) and
# global, 32 query / 8 kv heads of 128, hidden 2048 (overrides of the "gemma3-tiny" preset).
BENCH_OVERRIDES = dict(
    num_hidden_layers=8,
    layer_types=["sliding_attention", "full_attention"] * 4,
    sliding_window=4096,
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    query_pre_attn_scalar=128,
    vocab_size=32768,
    max_position_embeddings=131072,
)


def build(
    preset: str, kv: KVCacheConfig, kernel, num_pages: int, device: str, tiny: bool, fuse=False
):
    from torch_kvq.models import build_model

    overrides = BENCH_OVERRIDES if preset == "gemma3-tiny" and not tiny else {}
    model = build_model(
        preset,
        kv,
        0,
        num_pages=num_pages,
        dtype=torch.bfloat16,
        device=device,
        kernel=kernel,
        **overrides,
    )
    if fuse:
        model.fuse_projections()  # q/k/v and gate/up: one GEMM each
    if isinstance(kernel, FlashInferKernel):
        from torch_kvq.attention.kernels import flashinfer_jit

        flashinfer_jit.prebuild(kernel, model.kv_specs)  # FlashInfer's modules, in parallel
    return model


def fill_caches(model: torch.nn.Module) -> int:
    n = 0
    for mod in model.modules():
        if isinstance(mod, Attention):
            cache = mod.kv_cache
            std = 16.0 if cache.dtype == torch.float8_e4m3fn else 1.0
            for i in range(0, cache.shape[0], 4096):
                chunk = cache[i : i + 4096]
                chunk.copy_((torch.randn(chunk.shape, device=cache.device) * std).to(cache.dtype))
            n += 1
    return n


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":  # "cuda:1" on rank 1 of a tensor-parallel run
        torch.cuda.synchronize(device)


@torch.no_grad()
def run(
    label: str, model, fn, batch: int, ctx: int, steps: int, warmup: int, device: str, profile: int
) -> dict:
    alloc = model.allocator
    for i in range(batch):
        alloc.append(i, ctx - 1)
    vocab = model.config.vocab_size
    graphs = isinstance(fn, DecodeGraphRunner)

    def step() -> torch.Tensor:
        ids = torch.randint(0, vocab, (batch,), device=device)
        if graphs:  # the runner reads only the host fields: build on the CPU
            return fn(ids, alloc.build_batch([(i, 1) for i in range(batch)], device="cpu"))
        md = alloc.build_batch([(i, 1) for i in range(batch)], device=device)
        with model.forward_context(md):
            return fn(ids, md.positions)

    try:
        t0 = time.perf_counter()
        for _ in range(warmup):
            step()
        sync(device)
        first = time.perf_counter() - t0
        gc.collect()  # as serving engines do after warm-up: no collector pause inside the timing
        gc.freeze()
        spin_gpu(device)
        cuda = torch.device(device).type == "cuda"
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if cuda else []
        host, t0 = [], time.perf_counter()
        for i in range(steps):
            if cuda:
                marks[i].record()
            h0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - h0)
        if cuda:
            marks[steps].record()
        sync(device)
        step_s = (time.perf_counter() - t0) / steps
        # per-step time on the GPU's timeline (start to next start): the median ignores a stall
        timeline = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        gaps = sorted(timeline) or [step_s * 1e3]
        slow = sorted(range(len(timeline)), key=timeline.__getitem__)[-5:][::-1]
        host_slow = sorted(range(len(host)), key=host.__getitem__)[-5:][::-1]
        try:
            prof = profile_steps(step, device, profile) if profile else {}
        except Exception as e:  # noqa: BLE001 - the timing above stands; say why there is no profile
            prof = {"profile_error": repr(e)[:300]}
    finally:
        for i in range(batch):
            alloc.free(i)
    return {"variant": label, "batch": batch, "ctx": ctx, "step_ms": step_s * 1e3,
            "tokens_per_s": batch / step_s, "step_median_ms": gaps[len(gaps) // 2],
            "step_max_ms": gaps[-1], "host_ms": 1e3 * sorted(host)[len(host) // 2],
            # (step index, ms) of the 5 slowest steps on the GPU timeline and on the host: a
            # multiple of 16 apart = every sequence taking a new page (page size 16) at once
            "slowest_steps": [(i, round(timeline[i], 3)) for i in slow],
            "slowest_host_steps": [(i, round(1e3 * host[i], 3)) for i in host_slow],
            "warmup_s_incl_compile": first, **prof}  # fmt: skip


def spin_gpu(device: str, seconds: float = 1.0) -> None:
    """Keep the GPU busy for ``seconds`` so its clocks are up before timing (an idle H200 starts
    at a low SM clock; without this the first variant measured is the slowest)."""
    if torch.device(device).type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


# kernel kinds by name, first match wins; attention splits by the KV dtype in FlashInfer's template
# names (XQA, "kernel_mha", and our Triton decodes, "_decode_pages" / "_decode_balanced" /
# "_decode_tc4_tma" / "_combine*", run only on quantized caches here: the key keeps its first
# name, FP8's); our Triton cache writes (``kv_write*_kernel``: the quantized layers') apart
KERNEL_KINDS = (
    ("all_reduce", ("nccl", "AllReduce", "all_reduce")),  # tensor-parallel runs (bench_tp_decode)
    ("kv_write", ("kv_write",)),
    (
        "attention_fp8_kv",
        (
            "kernel_mha",
            "__nv_fp8",
            "_decode_pages",
            "_decode_balanced",
            "_decode_tc4_tma",
            "_combine",
        ),
    ),
    ("attention_bf16_kv", ("flashinfer::", "MergeState")),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "splitKreduce")),
)


def kernel_kind(name: str) -> str:
    return next((k for k, keys in KERNEL_KINDS if any(x in name for x in keys)), "other")


def profile_steps(step, device: str, n: int) -> dict:
    """torch.profiler over ``n`` steps: GPU kernel time per step (kernels only, by kind and the
    top 30 kernels with calls per step) against the step's wall time, and the top host ops by
    self CPU time (syncs show here)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(n):
            step()
        sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / n
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    dev = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    gpu_ms = sum(dev(e) for e in kernels) / 1e3 / n
    by_kind: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + dev(e) / 1e3 / n
    top = sorted(kernels, key=dev, reverse=True)[:30]
    top_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return {
        "profiled_step_ms": wall_ms,
        "gpu_kernel_ms_per_step": gpu_ms,
        **kernel_gaps(prof.events(), n),
        "gpu_busy_pct": 100 * gpu_ms / wall_ms,
        "gpu_ms_by_kind": {k: round(v, 4) for k, v in sorted(by_kind.items())},
        "kernels_per_step": [
            [e.key[:160], round(dev(e) / 1e3 / n, 4), e.count / n, kernel_kind(e.key)] for e in top
        ],
        "top_host_self_ms_per_step": _by_name(
            top_cpu, lambda e: e.self_cpu_time_total / 1e3 / n, 3
        ),
    }


def kernel_gaps(events, n: int, host_gap_us: float = 20.0) -> dict:
    """Idle GPU time between consecutive kernels (and copies) per step, from the profiler's
    timeline: gaps under ``host_gap_us`` are launch gaps inside a step's CUDA graph, longer ones
    the GPU waiting for the host (between steps; the profiler slows the host, so these overstate
    an unprofiled run's)."""
    from torch.autograd import DeviceType

    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA
    )
    short = long = 0.0
    count = 0
    end = spans[0][1] if spans else 0.0
    for start, stop in spans[1:]:
        gap = start - end
        if gap > 0:
            if gap < host_gap_us:
                short, count = short + gap, count + 1
            else:
                long += gap
        end = max(end, stop)
    return {
        "launch_gap_ms_per_step": round(short / 1e3 / n, 4),
        "launch_gaps_per_step": count / n,
        "host_wait_ms_per_step": round(long / 1e3 / n, 4),
    }


def kernel_time_bound(fp8: dict, bf16: dict, weight_bytes: int, copy_gbps: float) -> dict:
    """How far FP8 KV can take this model's step: the measured ratio of GPU kernel time
    (all-bf16 / FP8), and the ratio if the GEMMs read the weights at copy bandwidth and every
    kernel that is neither attention nor GEMM were free (attention as measured)."""
    floor_ms = weight_bytes / (copy_gbps * 1e9) * 1e3
    attn = lambda r: sum(v for k, v in r["gpu_ms_by_kind"].items() if k.startswith("attention"))  # noqa: E731
    return {
        "weights_at_copy_bw_ms": round(floor_ms, 4),
        "attention_ms": {"fp8": round(attn(fp8), 4), "bf16": round(attn(bf16), 4)},
        "kernel_ms": {"fp8": fp8["gpu_kernel_ms_per_step"], "bf16": bf16["gpu_kernel_ms_per_step"]},
        "measured_kernel_ratio": bf16["gpu_kernel_ms_per_step"] / fp8["gpu_kernel_ms_per_step"],
        "ratio_if_rest_at_bound": (attn(bf16) + floor_ms) / (attn(fp8) + floor_ms),
    }


def _by_name(events, ms, digits: int) -> dict[str, float]:
    """{name: ms}; FlashInfer's template names share long prefixes, so a truncated name gets a
    #2, #3 suffix instead of overwriting another kernel's entry."""
    out: dict[str, float] = {}
    for e in events:
        name, i = e.key[:100], 1
        while name in out:
            i += 1
            name = f"{e.key[:100]} #{i}"
        out[name] = round(ms(e), digits)
    return out


GRAPHS = " + CUDA graphs"


def variants(args) -> list[tuple[str, KVCacheConfig, object, str]]:
    """(label, kv config, kernel, how); a label ending in GRAPHS runs through DecodeGraphRunner."""
    fp8 = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=16)
    bf16 = KVCacheConfig("auto", page_size=16)
    if args.kernel == "reference":  # CPU smoke run of this script (no graphs: capture=False)
        kernel = lambda fp8_decode="tensor_cores", **kw: ReferenceKernel()  # noqa: E731
    else:
        kernel = FlashInferKernel
    fused = dict(phases="decode", unfused_attention=False)
    return [
        (f"kvq_backend (fp8, XQA){GRAPHS}", fp8, kernel(fp8_decode="xqa", **fused), "kvq"),
        (f"kvq_backend (fp8, tensor cores){GRAPHS}", fp8, kernel(**fused), "kvq"),
        (f"all-bf16, kvq_backend{GRAPHS}", bf16, kernel(phases="decode"), "kvq"),
        ("kvq_backend (fp8, XQA)", fp8, kernel(fp8_decode="xqa", **fused), "kvq"),
        ("all-bf16, kvq_backend", bf16, kernel(phases="decode"), "kvq"),
        ("eager unfused (fp8)", fp8, kernel(unfused_attention=True), "eager"),
        ("torch.compile inductor, no kvq passes (fp8)", fp8, kernel(unfused_attention=True), "inductor"),
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--preset", default="gemma3-tiny", help="gemma3-tiny is sized up (BENCH_OVERRIDES)"
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--fuse-projections", action="store_true",
        help="model.fuse_projections(): q/k/v and gate/up as one GEMM each (every variant)",
    )  # fmt: skip
    ap.add_argument(
        "--warmup", type=int, default=10,
        help="untimed steps first (with 3, the first 2 timed graph steps at 32 x 16k took 35-67 ms)",
    )  # fmt: skip
    ap.add_argument("--kernel", choices=["flashinfer", "reference"], default="flashinfer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the preset's own tiny size (smoke run)")
    ap.add_argument(
        "--profile-steps", type=int, default=3, help="steps under torch.profiler (0: none)"
    )
    ap.add_argument(
        "--only", nargs="*", default=None, help="run variants whose label has one of these"
    )
    args = ap.parse_args()
    env = environment()
    copy = copy_bandwidth() if args.device == "cuda" else None
    rows, weight_bytes = [], 0
    pages = (
        args.batch * (-(-(max(args.ctx) + args.warmup + args.steps + args.profile_steps + 8) // 16))
        + 16
    )
    todo = [v for v in variants(args) if not args.only or any(o in v[0] for o in args.only)]
    bar = Progress("bench_model_decode", len(todo) * len(args.ctx), unit="runs")
    for label, kv, kernel, how in todo:
        bar.update(status=f"{label}: building")
        try:
            model = build(
                args.preset, kv, kernel, pages, args.device, args.tiny, args.fuse_projections
            )
            # every weight is read once per decode step (the embedding is tied to the LM head)
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            fill_caches(model)
            fn = {"kvq": lambda m: torch.compile(m, backend=torch_kvq.kvq_backend),
                  "inductor": torch.compile, "eager": lambda m: m}[how](model)  # fmt: skip
            if label.endswith(GRAPHS):
                fn = DecodeGraphRunner(
                    model, fn, batch_sizes=(args.batch,), max_context=max(args.ctx) + args.warmup + args.steps + args.profile_steps + 8,
                    capture=args.device == "cuda",
                )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - recorded, the other variants still run
            rows.append({"variant": label, "batch": args.batch, "ctx": 0, "error": repr(e)[:400]})
            bar.echo(rows[-1])
            bar.update(bar.done + len(args.ctx))
            continue
        for ctx in args.ctx:
            bar.update(status=f"{label}, batch {args.batch} x {ctx}")
            try:
                rows.append(
                    run(
                        label,
                        model,
                        fn,
                        args.batch,
                        ctx,
                        args.steps,
                        args.warmup,
                        args.device,
                        args.profile_steps,
                    )
                )
            except Exception as e:  # noqa: BLE001
                rows.append(
                    {"variant": label, "batch": args.batch, "ctx": ctx, "error": repr(e)[:400]}
                )
            bar.echo(rows[-1])
            bar.update(bar.done + 1)
        model = fn = None
        torch._dynamo.reset()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    lines = ["## Model decode step (FlashInfer)", ""] + [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- preset {args.preset} {'(tiny)' if args.tiny else '(BENCH_OVERRIDES)'}, "
              f"kernel {args.kernel}, {args.steps} steps after {args.warmup} warm-up steps"
              f"{', projections fused' if args.fuse_projections else ''}", ""]  # fmt: skip
    lines += ["host ms/step: time for a step to return without waiting for the GPU; GPU busy: kernel time per "
              "step (torch.profiler) over the profiled step time. Low GPU busy = host/launch-bound.", ""]  # fmt: skip
    lines += ["step ms: mean over the timed steps; median / max: per step on the GPU's timeline (a stall "
              "shows as max >> median).", ""]  # fmt: skip
    lines += ["| batch x ctx | variant | step ms | median / max | tokens/s | host ms/step | GPU kernel ms (busy %) | x vs eager unfused | x vs all-bf16 (same graph mode) | first steps s (compile) |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    ok = [r for r in rows if "step_ms" in r]
    base = {r["ctx"]: r for r in ok if r["variant"] == "eager unfused (fp8)"}
    bf16 = {
        (r["ctx"], r["variant"].endswith(GRAPHS)): r
        for r in ok
        if r["variant"].startswith("all-bf16")
    }
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['batch']} x {r['ctx']} | {r['variant']} | failed: {r['error']} | | | | | | | |"
            )
            continue
        x = f"{base[r['ctx']]['step_ms'] / r['step_ms']:.1f}" if r["ctx"] in base else "-"
        b = bf16.get((r["ctx"], r["variant"].endswith(GRAPHS)))
        xb = f"{b['step_ms'] / r['step_ms']:.2f}" if b else "-"
        busy = (
            f"{r['gpu_kernel_ms_per_step']:.2f} ({r['gpu_busy_pct']:.0f}%)"
            if "gpu_busy_pct" in r
            else "-"
        )
        lines.append(f"| {r['batch']} x {r['ctx']} | {r['variant']} | {r['step_ms']:.3f} | {r['step_median_ms']:.3f} / {r['step_max_ms']:.2f} | {r['tokens_per_s']:.0f} "
                     f"| {r['host_ms']:.3f} | {busy} | {x} | {xb} | {r['warmup_s_incl_compile']:.1f} |")  # fmt: skip
    for r in rows:  # where the time goes, per variant and context
        for k in ("gpu_ms_by_kind", "top_host_self_ms_per_step"):
            if k in r:
                lines.append(f"- {r['variant']} @ {r['ctx']} {k}: {r[k]}")
    bounds = {}
    kinds = {(r["variant"], r["ctx"]): r for r in ok if "gpu_ms_by_kind" in r}
    for ctx in args.ctx:
        fp8_r = kinds.get((f"kvq_backend (fp8, XQA){GRAPHS}", ctx))
        bf16_r = kinds.get((f"all-bf16, kvq_backend{GRAPHS}", ctx))
        if fp8_r and bf16_r and copy:
            bounds[ctx] = b = kernel_time_bound(fp8_r, bf16_r, weight_bytes, copy["GBps"])
            lines.append(
                f"- {args.batch} x {ctx}, GPU kernel time all-bf16 / FP8 (XQA), with graphs: "
                f"measured {b['measured_kernel_ratio']:.3f}x ({b['kernel_ms']['bf16']:.3f} / "
                f"{b['kernel_ms']['fp8']:.3f} ms); with the GEMMs at copy bandwidth "
                f"({weight_bytes / 1e9:.2f} GB of weights: {b['weights_at_copy_bw_ms']:.3f} ms) "
                f"and all other non-attention kernels free: {b['ratio_if_rest_at_bound']:.3f}x"
            )
    write_results(
        "bench_model_decode",
        {
            "env": env,
            "args": vars(args),
            "copy_bandwidth": copy,
            "weight_bytes": weight_bytes,
            "kernel_time_bound": bounds,
            "rows": rows,
        },  # fmt: skip
        "\n".join(lines) + "\n",
    )


if __name__ == "__main__":
    main()
