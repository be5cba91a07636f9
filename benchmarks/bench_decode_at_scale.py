"""Decode at real model scale on one GPU: memory per layer group, capacity, throughput vs the bound.

Models (torch_kvq's own decoders at the real dimensions, random bf16 weights made on the GPU):
Llama-3.1-8B (32 layers, 32/8 heads of 128; FP8 config skips layers 0 and -1) and Gemma-3-12B
(48 layers, 16/8 heads of 256, 5 sliding (window 1024) : 1 global; FP8 config keeps the sliding
layers in bf16). Each KV config: all-bf16 vs FP8 through the tensor-core wrapper ("tc"), XQA and
our Triton kernel ("triton", ``FlashInferKernel(fp8_decode="triton")``); ``int8_per_token_head`` /
``fp8_per_token_head`` (the FP8 config's skip rule, the quantized layers on our Triton decode
whatever the kernel name says) and ``mixed``, one per-layer mode map per model (``MIXED``).
"tc" runs the tensor-core decode in fp16 math (FlashInferKernel's default since 2026-11-30 run
14), "tc-bf16" in bf16 (runs 10-13's "tc"). Sliding-window layers get pools of their own (``window_pages``): they hold ~1024 tokens per
sequence, not the context.

Per (model, kv config, kernel), one compiled model (kvq_backend) whose pools are sized by
``max_seqs_for_budget`` for the GPU memory left after weights and ``--headroom-gib``, and rows:
  * capacity: the largest batch at ``--capacity-ctx`` (16k) and its tokens/s,
  * ctx sweep at batch 32 (``--ctxs``), batch sweep at 16k (``--batches`` and the capacity batch);
a point whose pages do not fit the pools is a row with ``"fits": false`` (no timing).
``--fuse-projections``: q/k/v and gate/up as one GEMM each (``fuse_projections()``), for every
config alike. ``--weights-kn``: every Linear's weight laid out [K, N] (``weights_kn``);
``--blas cublaslt``: torch's GEMMs through cuBLASLt. ``--pdl``: Inductor's Triton kernels with
programmatic dependent launch.
``--max-autotune-gemm``: Inductor autotunes the GEMMs (Triton templates against
cuBLAS). ``--sample-clocks``: NVML clocks, power and clock-event reasons during the timed steps
(``clock_sampler.py``; row key ``clocks``). The headline point and the capacity point are
profiled (GPU time by kernel kind, ``--profile-steps``). Each point: sequences filled in chunks of ``--chunk`` tokens (as chunked prefill would: window
pools release behind), caches hold random values, a ``DecodeGraphRunner`` for that batch and
context, ``--warmup`` + ``--steps`` decode steps. The bound: (weight bytes + KV bytes the step
reads: ctx per full layer, min(ctx, window) per sliding layer) / measured copy bandwidth.

    python benchmarks/bench_decode_at_scale.py --models llama-3.1-8b gemma-3-12b
    python benchmarks/bench_decode_at_scale.py --smoke      # CPU: tiny shapes, reference kernel
Writes $OUT/decode_at_scale.json (rows as in issue 14) and decode_at_scale.md; plot with
benchmarks/plot_decode_at_scale.py.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model_decode import profile_steps, spin_gpu, sync  # noqa: E402
from clock_sampler import ClockSampler  # noqa: E402
from gpu_common import copy_bandwidth, environment, write_results  # noqa: E402

import torch_kvq  # noqa: E402
from torch_kvq.attention.graph_runner import DecodeGraphRunner  # noqa: E402
from torch_kvq.attention.kernels import FlashInferKernel, ReferenceKernel  # noqa: E402
from torch_kvq.attention.memory import max_seqs_for_budget, page_bytes, plan_kv_memory  # noqa: E402
from torch_kvq.kv_presets import kv_preset  # noqa: E402
from torch_kvq.models.gemma3 import Gemma3Model  # noqa: E402
from torch_kvq.models.llama import LlamaModel  # noqa: E402
from torch_kvq.models.presets import tiny_gemma3_config, tiny_llama_config  # noqa: E402
from torch_kvq.spec import KVCacheConfig  # noqa: E402
from torch_kvq.spec_channels import KBasis, KChannelScale  # noqa: E402

PAGE = 16
# --max-autotune-gemm: the GEMMs are 89% (Llama) / 84% (Gemma) of copy bandwidth on cuBLAS at batch
# 32 (runs 36-37), the largest share of the step outside attention
MAX_AUTOTUNE_GEMM = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}
# --pdl: Inductor's Triton kernels launch with programmatic dependent launch (Hopper): each may
# start while the kernel before it drains and waits (gdc_wait) only before it reads that kernel's
# output; ~685 kernels per Gemma step (run 47)
PDL = {"triton.enable_pdl": True}


def inductor_patch(text: str) -> dict[str, Any]:
    """``--inductor key=value``: one Inductor config entry whose key exists in this torch."""
    import ast

    import torch._inductor.config as cfg

    key, sep, value = text.partition("=")
    obj = cfg
    for part in key.split(".")[:-1]:
        obj = getattr(obj, part, None)
    if not sep or obj is None or not hasattr(obj, key.split(".")[-1]):
        raise argparse.ArgumentTypeError(
            f"--inductor {text!r}: expected KEY=VALUE with KEY an Inductor config of torch "
            f"{torch.__version__} (e.g. combo_kernels=True)"
        )
    try:
        return {key: ast.literal_eval(value)}
    except (ValueError, SyntaxError) as e:
        raise argparse.ArgumentTypeError(
            f"--inductor {text!r}: {value!r} is not a Python literal"
        ) from e


LLAMA_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
GEMMA3_12B = dict(
    vocab_size=262144, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
    sliding_window=1024, max_position_embeddings=131072,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8,
)  # fmt: skip
MODELS = {  # name: (class, config, FP8 config's skip rule)
    "llama-3.1-8b": (LlamaModel, tiny_llama_config, LLAMA_8B, (0, -1)),
    "gemma-3-12b": (Gemma3Model, tiny_gemma3_config, GEMMA3_12B, ("sliding_window",)),
}
SMOKE = {
    "llama-3.1-8b": dict(num_hidden_layers=4),
    "gemma-3-12b": dict(num_hidden_layers=6, sliding_window=32,
                        layer_types=["sliding_attention"] * 5 + ["full_attention"]),
}  # fmt: skip


# per-layer mode maps (KVCacheConfig.layer_modes): Llama int8 per (token, head) with layer 0 in bf16
# and the last layer FP8 per tensor; Gemma's sliding layers bf16, its global ones int8 per (token,
# head), layer 0 (sliding) FP8 per tensor
MIXED = {
    "llama-3.1-8b": ("int8_per_token_head", ((0, "auto"), (-1, "fp8"))),
    "gemma-3-12b": ("auto", (("full_attention", "int8_per_token_head"), (0, "fp8"))),
}
# the int4-recommended preset (torch_kvq.kv_presets) on shapes with no trained weights: Llama
# takes SmolLM2-135M's measured layers (8 of its 32 layers k8v4, as 8 of SmolLM2's 30), Gemma
# every full-attention layer k8v4 (as Gemma-3-270M's measurement: all 3 of its full layers)
RECOMMENDED_LAYERS = {
    "llama-3.1-8b": (1, 3, 4, 6, 12, 13, 16, 22),
    "gemma-3-12b": tuple(range(5, 48, 6)),
}
# the same on the smoke shapes (SMOKE), whose few layers hold only the first of them
SMOKE_LAYERS = {"llama-3.1-8b": (1, 3), "gemma-3-12b": (5,)}
KV_CONFIGS = ("bf16", "fp8", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head",
              "mixed", "int8_per_token_head-all", "fp8_per_token_head-all",
              "int4_per_token_head-all", "int4-recommended",
              "int4_per_token_head-all+channels", "tc4_per_token_head-all")  # fmt: skip


def kv_configs(skip, page: int = PAGE) -> dict[str, KVCacheConfig]:
    """The all-bf16 and FP8 configs (``skip``: the FP8 config's skip rule), ``page`` tokens a
    page."""
    return {
        "bf16": KVCacheConfig("auto", page_size=page),
        "fp8": KVCacheConfig("fp8", skip_layers=skip, page_size=page),
    }


def kv_config(name: str, model_name: str, page: int = PAGE, smoke: bool = False) -> KVCacheConfig:
    """The KV config ``name`` (``KV_CONFIGS``) for ``model_name``: the per-(token, head) modes
    with the FP8 config's skip rule (``-all``: on every layer), ``mixed`` with the model's
    ``MIXED`` map, ``int4-recommended`` with ``RECOMMENDED_LAYERS`` (``smoke``: ``SMOKE_LAYERS``)."""
    skip = MODELS[model_name][3]
    if name in ("bf16", "fp8"):
        return kv_configs(skip, page)[name]
    if name == "mixed":
        default, rules = MIXED[model_name]
        return KVCacheConfig(default, layer_modes=rules, page_size=page)
    if name == "int4-recommended":
        layers = (SMOKE_LAYERS if smoke else RECOMMENDED_LAYERS)[model_name]
        return kv_preset(name, sensitive_layers=layers, page_size=page)
    if name not in KV_CONFIGS:
        raise ValueError(f"unknown kv config {name!r}; expected one of {list(KV_CONFIGS)}")
    if name.endswith("+channels"):  # every layer int4 with K channel scales (their cost)
        return synthetic_channels(kv_config(name.removesuffix("+channels"), model_name, page, smoke),
                                  model_name, smoke)  # fmt: skip
    if name == "tc4_per_token_head-all":  # every layer tc4, its K bases seeded (its cost)
        return synthetic_bases(KVCacheConfig("tc4_per_token_head", page_size=page), model_name,
                               smoke)  # fmt: skip
    if name.endswith("-all"):
        return KVCacheConfig(name.removesuffix("-all"), page_size=page)
    return KVCacheConfig(name, skip_layers=skip, page_size=page)


def kv_shape(model_name: str, smoke: bool) -> tuple[int, int, int]:
    """(layers, kv heads, head size) of ``model_name``'s shape (``smoke``: ``SMOKE``'s)."""
    _, config_fn, shape, _ = MODELS[model_name]
    mc = config_fn(**(SMOKE[model_name] if smoke else shape))
    d = mc.get("head_dim") or mc["hidden_size"] // mc["num_attention_heads"]
    return mc["num_hidden_layers"], mc["num_key_value_heads"], d


def synthetic_channels(cfg: KVCacheConfig, model_name: str, smoke: bool) -> KVCacheConfig:
    """``cfg`` (int4 on every layer) with K channel scales and means on every layer: seeded
    values in a calibrated one's range (s 0.5..2), no trained weights to calibrate on; for the
    step's cost, which does not depend on the values."""
    layers, kh, d = kv_shape(model_name, smoke)
    g = torch.Generator().manual_seed(0)
    channels = {
        i: KChannelScale(torch.rand(kh, d, generator=g) * 1.5 + 0.5, torch.randn(kh, d, generator=g))
        for i in range(layers)
    }
    return replace(cfg, k_channel_scales=channels)


def synthetic_bases(cfg: KVCacheConfig, model_name: str, smoke: bool) -> KVCacheConfig:
    """``cfg`` (tc4 on every layer) with a K basis on every layer: seeded orthogonal matrices (a
    calibrated basis is a rotation times a balancing scale), no trained weights to calibrate on;
    for the step's cost, which does not depend on the values."""
    layers, kh, d = kv_shape(model_name, smoke)
    g = torch.Generator().manual_seed(0)
    bases = {
        i: KBasis.of(torch.linalg.qr(torch.randn(kh, d, d, generator=g))[0]) for i in range(layers)
    }
    return replace(cfg, k_bases=bases)


def make_kernel(name: str, smoke: bool):
    if smoke:
        return ReferenceKernel()
    opts = dict(phases="decode", unfused_attention=False)
    if name in ("xqa", "triton"):
        return FlashInferKernel(fp8_decode=name, **opts)
    # "tc": tensor-core decode in fp16 math (the default); "tc-bf16": in the model dtype
    math = "model" if name == "tc-bf16" else "fp16"
    return FlashInferKernel(fp8_decode="tensor_cores", fp8_decode_math=math, **opts)


def build(model_name: str, kv: KVCacheConfig, kernel, device: str, smoke: bool, pages, windows):
    cls, config_fn, shape, _ = MODELS[model_name]
    overrides = SMOKE[model_name] if smoke else shape
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # random weights made on the device, in bf16
    try:
        model = cls(config_fn(**overrides), kv, pages, dtype=torch.bfloat16, device=device,
                    kernel=kernel, window_pages=windows).eval()  # fmt: skip
    finally:
        torch.set_default_dtype(old)
    return model


def weights_kn(model: torch.nn.Module) -> int:
    """Store every ``nn.Linear``'s weight transposed: the same [N, K] tensor, laid out [K, N] in
    memory (strides (1, N)), so that ``F.linear`` runs ``x @ w_kn`` (cuBLAS NN) instead of
    ``x @ w^T`` (TN; runs 61-63 of 2026-12-01, RESULTS.md). Tied embeddings (not Linear) stay.
    Returns how many weights moved."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight
            mod.weight = torch.nn.Parameter(w.detach().t().contiguous().t(), w.requires_grad)
            n += 1
    return n


def step_bytes(model, batch: int, ctx: int, weight_bytes: int) -> int:
    """Bytes a decode step reads: every weight once, each layer's live KV."""
    kv = 0
    for s in model.kv_specs:
        tokens = ctx if s.sliding_window is None else min(ctx, s.sliding_window)
        kv += batch * tokens * page_bytes(s) // s.page_size
    return weight_bytes + kv


def fill(model, batch: int, ctx: int, chunk: int) -> None:
    """Reserve ``ctx - 1`` tokens per sequence in chunks (window pools release behind)."""
    for i in range(batch):
        done = 0
        while done < ctx - 1:
            n = min(chunk, ctx - 1 - done)
            model.allocator.append(i, n)
            done += n


def random_caches(model) -> None:
    """Random values in every cache (int8 codes ~N(0, 40)); per-(token, head) scales 1/40."""
    for a in model.attention_layers:
        cache = a.kv_cache
        std = {torch.float8_e4m3fn: 16.0, torch.int8: 40.0}.get(cache.dtype, 1.0)
        for i in range(0, cache.shape[0], 4096):
            part = cache[i : i + 4096]
            x = torch.randn(part.shape, device=cache.device) * std
            part.copy_(x.clamp(-127, 127) if cache.dtype == torch.int8 else x)
        if getattr(a, "kv_scale", None) is not None:
            a.kv_scale.fill_(1 / 40)


def layer_bytes(model) -> int:
    """Every layer's cache bytes: codes and, where a layer has them, per-(token, head) scales."""
    total = 0
    for a in model.attention_layers:
        for t in (a.kv_cache, getattr(a, "kv_scale", None)):
            total += 0 if t is None else t.numel() * t.element_size()
    return total


@torch.no_grad()
def point(model, fn, batch: int, ctx: int, args, profile: int) -> dict:
    """One (batch, ctx) point through a DecodeGraphRunner; the pages are freed afterwards."""
    alloc, device = model.allocator, str(model.device)
    limit = ctx + args.warmup + args.steps + profile + 2
    runner = DecodeGraphRunner(model, fn, batch_sizes=(batch,), max_context=limit,
                               capture=device.startswith("cuda"))  # fmt: skip
    try:
        fill(model, batch, ctx, args.chunk)
        vocab = model.config.vocab_size

        def step():
            ids = torch.randint(0, vocab, (batch,), device=device)
            return runner(ids, alloc.build_batch([(i, 1) for i in range(batch)], device="cpu"))

        settle = min(2, args.warmup)
        t0 = time.perf_counter()
        for _ in range(args.warmup - settle):
            step()
        sync(device)
        warm = time.perf_counter() - t0
        gc.collect()
        # as serving engines do after capture (vLLM): long-lived objects out of the collector's
        # sweeps (run 21's single 45-117 ms steps are not explained by it: RESULTS.md)
        gc.freeze()
        spin_gpu(device, 0.5)
        # the last warm-up steps right before the timed ones: the spin's GEMMs run at the 700 W
        # power cap and leave the SM clock at 1590-1635 MHz for ~0.1 s (run 40's NVML samples)
        for _ in range(settle):
            step()
        cuda = device.startswith("cuda")
        marks = (
            [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)] if cuda else []
        )
        sampler = ClockSampler(torch.cuda.current_device()) if args.sample_clocks and cuda else None
        with sampler or contextlib.nullcontext():
            t0 = time.perf_counter()
            for i in range(args.steps):
                if cuda:
                    marks[i].record()
                step()
            if cuda:
                marks[-1].record()
            sync(device)
            step_s = (time.perf_counter() - t0) / args.steps
        if args.sample_clocks:
            clocks = sampler.summary() if sampler else {"available": False, "why": "not on CUDA"}
        in_order = [round(a.elapsed_time(b), 3) for a, b in zip(marks, marks[1:])]
        times = sorted(in_order) or [step_s * 1e3]
        replay = replay_only(runner, batch, args.steps) if cuda else []
        prof = profile_steps(step, device, profile) if profile else {}
    finally:
        gc.unfreeze()
        for i in range(batch):
            if i in alloc.sequences:
                alloc.free(i)
        runner.close()
    median = times[len(times) // 2]
    # the mean of the in-stream intervals: every timed step back to back on the GPU's clock, idle
    # between steps included (a host that falls behind shows). The wall clock (``wall_step_ms``)
    # starts while the settle steps still run (runs 43-46: 2-5% above) and ends at the sync.
    mean = sum(in_order) / len(in_order) if in_order else step_s * 1e3
    return {"step_ms": mean, "step_median_ms": median, "wall_step_ms": step_s * 1e3,
            "step_max_ms": times[-1], "tokens_per_s": batch * 1e3 / mean,
            "tokens_per_s_median": batch * 1e3 / median, "gc_frozen": True,
            "step_times_ms": in_order,
            # the captured step replayed back to back, no host work between: the step's GPU time
            # with its in-graph launch gaps; step_ms above it is the host's share
            **({"replay_ms": sum(replay) / len(replay),
                "replay_median_ms": sorted(replay)[len(replay) // 2]} if replay else {}),
            "warmup_s_incl_capture": round(warm, 2), **prof,
            **({"clocks": clocks} if args.sample_clocks else {})}  # fmt: skip


def replay_only(runner: DecodeGraphRunner, batch: int, steps: int) -> list[float]:
    """ms of ``steps`` back-to-back replays of the batch's captured graph (the last step's inputs;
    its cache writes repeat into the same slots), timed by in-stream events."""
    slot = runner._slots.get(batch)  # benchmark-only peek at the runner's graph for this size
    if slot is None or slot.graph is None:
        return []
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    for i in range(steps):
        marks[i].record()
        slot.graph.replay()
    marks[-1].record()
    torch.cuda.synchronize()
    return [round(a.elapsed_time(b), 3) for a, b in zip(marks, marks[1:])]


def run_variant(
    model_name: str, kv_name: str, kernel_name: str, args, env, copy_gbps
) -> list[dict]:
    kv = kv_config(kv_name, model_name, args.page, args.smoke)
    device = "cpu" if args.smoke else "cuda"
    kernel = make_kernel(kernel_name, args.smoke)
    cap_ctx = args.capacity_ctx
    margin = args.warmup + args.steps + args.profile_steps + 2
    # build with minimal pools, measure the memory left beside the weights, size the pools to it
    model = build(model_name, kv, kernel, device, args.smoke, 1, 1 if args.windowed else None)
    if args.fuse_projections:
        model.fuse_projections()  # q/k/v and gate/up: one GEMM each, as serving engines run
    if args.weights_kn:
        weights_kn(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    specs = model.kv_specs
    if device == "cuda":
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
        budget = int(free - args.headroom_gib * 2**30)
    else:
        budget = args.smoke_budget_mib * 2**20
    cap = max_seqs_for_budget(specs, budget, cap_ctx + margin, windowed=args.windowed,
                              prefill_chunk=args.chunk)  # fmt: skip
    max_batch = cap.max_seqs
    model.num_pages, model.window_pages = cap.num_pages, cap.window_pages or None
    model.configure_kv(kv)  # the caches at their planned size
    if isinstance(kernel, FlashInferKernel):
        from torch_kvq.attention.kernels import flashinfer_jit

        flashinfer_jit.prebuild(kernel, model.kv_specs)
    random_caches(model)
    kv_bytes = layer_bytes(model)
    backend = torch_kvq.kvq_backend
    patches = {**(MAX_AUTOTUNE_GEMM if args.max_autotune_gemm else {}), **(PDL if args.pdl else {}),
               **args.inductor}  # fmt: skip
    if patches:  # Inductor config for this compile only (GEMM autotuning, PDL, --inductor)
        backend = torch_kvq.make_kvq_backend(config_patches=patches)
    fn = torch.compile(model, backend=backend)
    base = {"model": model_name, "kv_config": kv_name, "kernel": kernel_name if kv_name != "bf16" else "bf16",
            "kv_gib": kv_bytes / 2**30, "kv_budget_gib": budget / 2**30, "max_batch_at_capacity_ctx": max_batch,
            "capacity_ctx": cap_ctx, "page": kv.page_size, "weights_gib": weight_bytes / 2**30, "windowed_pools": args.windowed,
            "fused_projections": args.fuse_projections, "max_autotune_gemm": args.max_autotune_gemm,
            "pdl": args.pdl, "inductor_patches": args.inductor, "blas": args.blas,
            "weights_kn": args.weights_kn,
            "date": env["date_utc"], "gpu": env.get("gpu", "cpu"), "commit": args.commit}  # fmt: skip
    points = [("ctx_sweep", 32 if not args.smoke else 2, c) for c in args.ctxs]
    points += [("batch_sweep", b, cap_ctx) for b in args.batches if (b, cap_ctx) != (32, cap_ctx)
               or cap_ctx not in args.ctxs]  # fmt: skip
    points += [("capacity", max_batch, cap_ctx)] if args.capacity else []
    rows = []
    for kind, batch, ctx in points:
        row = {**base, "sweep": kind, "batch": batch, "ctx": ctx}
        need = plan_kv_memory(specs, batch, ctx + margin, windowed=args.windowed,
                              prefill_chunk=args.chunk)  # fmt: skip
        fits = need.num_pages <= cap.num_pages and all(
            n <= cap.window_pages.get(w, 0) for w, n in need.window_pages.items()
        )
        nbytes = step_bytes(model, batch, ctx, weight_bytes)
        row["bound_tokens_per_s"] = batch / (nbytes / (copy_gbps * 1e9)) if copy_gbps else None
        row["fits"] = fits
        if fits:
            # the GPU time by kind: at the headline point and the largest batch
            prof = args.profile_steps if (batch, ctx) == (32, 16384) or kind == "capacity" else 0
            try:
                row.update(point(model, fn, batch, ctx, args, prof))
                if row["bound_tokens_per_s"]:
                    row["pct_of_bound"] = 100 * row["tokens_per_s"] / row["bound_tokens_per_s"]
            except Exception as e:  # noqa: BLE001 - recorded, the other points still run
                row["error"] = repr(e)[:400]
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
               if k not in ("kernels_per_step", "top_host_self_ms_per_step")}, flush=True)  # fmt: skip
        rows.append(row)
    del model, fn
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8:tc", "fp8:xqa"],
                    help=f"<kv config>[:<kernel>], kv configs {list(KV_CONFIGS)}, kernels tc, "
                    "tc-bf16, xqa, triton (e.g. int8_per_token_head:tc, mixed:triton)")  # fmt: skip
    ap.add_argument("--ctxs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--capacity-ctx", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=40,
                    help="timed steps; the first few of a point run slow (RESULTS.md, runs 28-33)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=1024, help="tokens per fill append (one sequence)")
    ap.add_argument("--headroom-gib", type=float, default=6.0,
                    help="GPU memory kept for activations, workspaces and graphs")  # fmt: skip
    ap.add_argument("--no-windowed", dest="windowed", action="store_false",
                    help="one shared page table (sliding layers hold the whole context)")  # fmt: skip
    ap.add_argument("--no-capacity", dest="capacity", action="store_false",
                    help="skip the largest-batch point")  # fmt: skip
    ap.add_argument("--fuse-projections", action="store_true",
                    help="model.fuse_projections(): q/k/v and gate/up as one GEMM each")  # fmt: skip
    ap.add_argument("--max-autotune-gemm", action="store_true",
                    help="Inductor's GEMM autotuning (Triton templates against cuBLAS) through "
                         "make_kvq_backend(config_patches=...)")  # fmt: skip
    ap.add_argument("--pdl", action="store_true",
                    help="Inductor's Triton kernels with programmatic dependent launch "
                         "(config triton.enable_pdl through make_kvq_backend(config_patches=...))")  # fmt: skip
    ap.add_argument(
        "--inductor",
        type=inductor_patch,
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="Inductor config for the compile, e.g. combo_kernels=True (Python literals)",
    )
    ap.add_argument("--weights-kn", action="store_true",
                    help="every Linear's weight stored [K, N] (weights_kn): cuBLAS NN GEMMs")  # fmt: skip
    ap.add_argument("--blas", choices=("cublas", "cublaslt"), default="cublas",
                    help="torch's preferred BLAS library for the GEMMs (captured in the graphs)")  # fmt: skip
    ap.add_argument("--sample-clocks", action="store_true",
                    help="NVML clocks, power and clock-event reasons every 5 ms of the timed steps "
                         "(clock_sampler.py; a thread: off by default)")  # fmt: skip
    ap.add_argument("--page", type=int, default=PAGE, help="tokens per cache page, every config")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, reference kernel")
    ap.add_argument("--smoke-budget-mib", type=int, default=64)
    ap.add_argument("--commit", default=os.environ.get("KVQ_COMMIT") or _git_head(),
                    help="recorded in every row (default $KVQ_COMMIT, else git HEAD; on the device "
                    "machine .git is stale: pass KVQ_COMMIT)")  # fmt: skip
    args = ap.parse_args()
    args.inductor = dict(kv for patch in args.inductor for kv in patch.items())
    if args.blas != "cublas":  # torch's default on CUDA
        if args.smoke:
            ap.error(f"--blas {args.blas}: a CUDA library; --smoke runs on the CPU")
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.pdl and not hasattr(torch._inductor.config.triton, "enable_pdl"):
        ap.error(f"--pdl: torch {torch.__version__}'s Inductor has no config triton.enable_pdl")
    if args.smoke:
        args.ctxs, args.batches, args.capacity_ctx = [64, 128], [1, 2], 96
        args.steps, args.warmup, args.profile_steps, args.chunk = 2, 1, 0, 32
    env = environment()
    copy_gbps = None if args.smoke else copy_bandwidth()["GBps"]
    rows = []
    for m in args.models:
        for v in args.kv:
            kv_name, _, kernel_name = v.partition(":")
            rows += run_variant(m, kv_name, kernel_name or "bf16", args, env, copy_gbps)
            # after every variant: a run cut short by its time limit keeps what it measured
            write_results("decode_at_scale", {"env": env, "copy_GBps": copy_gbps, "rows": rows},
                          markdown(rows, env, copy_gbps))  # fmt: skip


def _git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"  # fmt: skip
    except Exception:  # noqa: BLE001
        return "unknown"


def markdown(rows: list[dict], env: dict, copy_gbps) -> str:
    lines = [f"## Decode at scale ({env.get('gpu', 'cpu')}, {env['date_utc']}, copy {copy_gbps} GB/s)",
             "", "| model | kv | kernel | batch | ctx | step ms | tokens/s | bound tokens/s | % bound | KV GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if not r.get("fits"):
            tps = "does not fit"
        else:
            tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else r.get("error", "?")
        pct = f"{r['pct_of_bound']:.0f}" if "pct_of_bound" in r else ""
        bound = f"{r['bound_tokens_per_s']:.0f}" if r.get("bound_tokens_per_s") else ""
        step = f"{r['step_ms']:.2f}" if "step_ms" in r else ""
        lines.append(f"| {r['model']} | {r['kv_config']} | {r['kernel']} | {r['batch']} | {r['ctx']} "
                     f"| {step} | {tps} | {bound} | {pct} | {r['kv_gib']:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
