"""Decode attention per layer on FlashInfer (GPU): fused FP8 vs unfused vs bf16 vs raw FlashInfer.

QH=32 KH=8 D=128 page 16, bf16 queries, pages shuffled. Paths, per (batch, context):
  fp8_fused_tc / fp8_fused_xqa(_fp8out): ``kvq.paged_attention_fp8`` reading the FP8 cache in place
  unfused_eager: ``kvq.dequantize_kv_cache`` (whole cache -> bf16) + ``kvq.paged_attention``
  bf16: ``kvq.paged_attention`` on a bf16 cache (a skipped layer)
  raw_tc_fp8 / raw_xqa_fp8 / raw_tc_bf16: the same FlashInfer kernels called directly
Each time is CUDA events over back-to-back calls; "% copy" is bytes of K+V read per second over the
measured device-to-device copy bandwidth (bytes read + written). Also: prefill throughput (bf16
and FP8 layers), plan cost per batch, and a small launch-bound probe.

    python benchmarks/bench_decode_attention.py        # writes $OUT/bench_decode_attention.{json,md}
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import copy_bandwidth, environment, random_cache, time_per_call, write_results  # noqa: E402

from torch_kvq.attention import BatchMetadata, forward_context  # noqa: E402
from torch_kvq.attention.kernels import FlashInferKernel  # noqa: E402
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig  # noqa: E402
from torch_kvq.spec_resolve import resolve_layer_specs  # noqa: E402

QH, KH, D, PAGE = 32, 8, 128, 16
SCALE = 1 / 16  # stored values ~N(0, 16), real values ~N(0, 1)
OUT_SCALE = 1 / 64
BF16 = torch.bfloat16


def specs():
    info = [AttentionLayerInfo("bench.attn", QH, KH, D)]
    fp8 = resolve_layer_specs(
        KVCacheConfig("fp8", page_size=PAGE, default_k_scale=SCALE, default_v_scale=SCALE), info
    )[0]
    bf16 = resolve_layer_specs(KVCacheConfig("auto", page_size=PAGE), info)[0]
    return fp8, bf16


def metadata(batch: int, ctx: int, qo: int, seed: int = 0) -> BatchMetadata:
    per_seq = -(-ctx // PAGE)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(batch * per_seq, generator=gen).tolist()
    tables = [perm[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    return BatchMetadata.build(tables, [ctx] * batch, [qo] * batch, PAGE, device="cuda")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def decode_case(batch: int, ctx: int, copy_gbps: float, rounds: int) -> list[dict]:
    """Every path timed once per round, rounds interleaved (A B C .. A B C ..): a difference
    between paths smaller than their spread over rounds is noise."""
    import flashinfer
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    fp8, bf16 = specs()
    md = metadata(batch, ctx, 1)
    pages = batch * (-(-ctx // PAGE))
    cache8 = random_cache(pages, PAGE, KH, D, torch.float8_e4m3fn, 16.0)
    cache16 = random_cache(pages, PAGE, KH, D, BF16, 1.0)
    q = torch.randn(batch, QH, D, device="cuda", dtype=BF16)
    kv_bytes = batch * ctx * KH * D * 2
    op8, op, deq = (torch.ops.kvq.paged_attention_fp8, torch.ops.kvq.paged_attention,
                    torch.ops.kvq.dequantize_kv_cache)  # fmt: skip
    tc = FlashInferKernel(unfused_attention=True)
    xqa = FlashInferKernel(fp8_decode="xqa", phases="decode", unfused_attention=False)
    ws = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    raw = {}
    for name, kv_dtype in (("fp8", torch.float8_e4m3fn), ("bf16", BF16)):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_tensor_cores=True, backend="fa2"
        )
        w.plan(md.kv_indptr, md.kv_indices, md.kv_last_page_len, QH, KH, D, PAGE, q_data_type=BF16,
               kv_data_type=kv_dtype, o_data_type=BF16, sm_scale=fp8.sm_scale)  # fmt: skip
        raw[name] = w
    xws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    width = max(len(p) for p in md.page_tables)
    bt = torch.tensor(
        [list(p) + [0] * (width - len(p)) for p in md.page_tables], dtype=torch.int32, device="cuda"
    )
    # path -> (forward-context (specs, kernel) or None, fn, K+V bytes read, iterations)
    paths = {
        "fp8_fused_tc": ((fp8, tc), lambda: op8(q, cache8, SCALE, SCALE, fp8.name), kv_bytes, 30),
        "fp8_fused_xqa": ((fp8, xqa), lambda: op8(q, cache8, SCALE, SCALE, fp8.name), kv_bytes, 30),
        "fp8_fused_xqa_fp8out": ((fp8, xqa), lambda: op8(q, cache8, SCALE, SCALE, fp8.name, OUT_SCALE), kv_bytes, 30),
        "unfused_eager": ((fp8, tc), lambda: op(q, deq(cache8, SCALE, SCALE, BF16), fp8.name), None, 5),
        "bf16": ((bf16, FlashInferKernel()), lambda: op(q, cache16, bf16.name), 2 * kv_bytes, 30),
        "raw_tc_fp8": (None, lambda: raw["fp8"].run(q, cache8, k_scale=SCALE, v_scale=SCALE), kv_bytes, 30),
        "raw_xqa_fp8": (None, lambda: trtllm_batch_decode_with_kv_cache(
            q, cache8, xws, bt, md.seq_lens, ctx, bmm1_scale=SCALE * fp8.sm_scale, bmm2_scale=SCALE,
            kv_layout="NHD", backend="xqa"), kv_bytes, 30),
        "raw_tc_bf16": (None, lambda: raw["bf16"].run(q, cache16), 2 * kv_bytes, 30),
    }  # fmt: skip
    outs: dict[str, torch.Tensor] = {}
    times: dict[str, list[dict]] = {p: [] for p in paths}
    for _ in range(rounds):
        for path, (fc, fn, _, iters) in paths.items():
            cm = forward_context(md, [fc[0]], fc[1]) if fc else contextlib.nullcontext()
            with cm:
                outs.setdefault(path, fn())
                times[path].append(time_per_call(fn, iters=iters, reps=1))
    rows = []
    for path, (_, _, nbytes, _) in paths.items():
        ms = [t["ms"] for t in times[path]]
        row = {"batch": batch, "ctx": ctx, "path": path, "ms": statistics.median(ms), "ms_min": min(ms),
               "ms_max": max(ms), "host_us": statistics.median(t["host_us"] for t in times[path])}  # fmt: skip
        if nbytes:
            row["GBps"] = nbytes / (row["ms"] * 1e-3) / 1e9
            row["pct_copy"] = 100 * row["GBps"] / copy_gbps
            row["pct_copy_best"] = 100 * nbytes / (row["ms_min"] * 1e-3) / 1e9 / copy_gbps
        rows.append(row)
    by = {r["path"]: r for r in rows}
    for r in rows:
        r["x_vs_unfused"] = by["unfused_eager"]["ms"] / r["ms"]
    for ours, rw in (
        ("fp8_fused_tc", "raw_tc_fp8"),
        ("fp8_fused_xqa", "raw_xqa_fp8"),
        ("bf16", "raw_tc_bf16"),
    ):
        by[ours]["overhead_vs_raw_pct"] = 100 * (by[ours]["ms"] / by[rw]["ms"] - 1)
    checks = {
        "fp8_fused_tc vs raw_tc_fp8": rel(outs["fp8_fused_tc"], outs["raw_tc_fp8"]),
        "fp8_fused_xqa vs raw_xqa_fp8": rel(outs["fp8_fused_xqa"], outs["raw_xqa_fp8"]),
        "fp8_fused_xqa vs fp8_fused_tc": rel(outs["fp8_fused_xqa"], outs["fp8_fused_tc"]),
        "unfused_eager vs fp8_fused_tc": rel(outs["unfused_eager"], outs["fp8_fused_tc"]),
        "xqa_fp8out*scale vs fp8_fused_xqa": rel(outs["fp8_fused_xqa_fp8out"].float() * OUT_SCALE, outs["fp8_fused_xqa"]),
    }  # fmt: skip
    rows.append({"batch": batch, "ctx": ctx, "path": "checks (rel err between outputs)", **checks})
    return rows


def prefill_case(batch: int, length: int) -> list[dict]:
    fp8, bf16 = specs()
    md = metadata(batch, length, length)
    pages = batch * (-(-length // PAGE))
    q = torch.randn(batch * length, QH, D, device="cuda", dtype=BF16)
    flops = 4 * D * QH * batch * length * (length + 1) / 2
    rows = []
    for spec, dtype, std in ((fp8, torch.float8_e4m3fn, 16.0), (bf16, BF16, 1.0)):
        cache = random_cache(pages, PAGE, KH, D, dtype, std)
        with forward_context(md, [spec], FlashInferKernel(unfused_attention=False)):
            if spec.is_quantized:
                t = time_per_call(
                    lambda c=cache, s=spec: torch.ops.kvq.paged_attention_fp8(
                        q, c, SCALE, SCALE, s.name
                    ),
                    iters=10,
                )
            else:
                t = time_per_call(
                    lambda c=cache, s=spec: torch.ops.kvq.paged_attention(q, c, s.name), iters=10
                )
        rows.append({"batch": batch, "len": length, "cache": str(dtype).replace("torch.", ""), **t,
                     "tokens_per_s": batch * length / (t["ms"] * 1e-3), "TFLOPs": flops / (t["ms"] * 1e-3) / 1e12})  # fmt: skip
    return rows


def plan_cost(batch: int, ctx: int) -> list[dict]:
    fp8, _ = specs()
    md = metadata(batch, ctx, 1)
    rows = []
    for label, kernel in (
        ("tc, fused only (1 plan)", FlashInferKernel(unfused_attention=False)),
        ("tc, + unfused plan (2 plans)", FlashInferKernel(unfused_attention=True)),
        (
            "xqa decode (block table only)",
            FlashInferKernel(fp8_decode="xqa", phases="decode", unfused_attention=False),
        ),
    ):
        times = []
        for _ in range(25):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with forward_context(md, [fp8], kernel):
                pass
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e6)
        rows.append(
            {
                "batch": batch,
                "ctx": ctx,
                "kernel": label,
                "plan_us_median": statistics.median(times[5:]),
            }
        )
    return rows


def markdown(env: dict, copy: dict, dec: list[dict], pre: list[dict], plans: list[dict]) -> str:
    lines = ["## Decode attention per layer (FlashInfer, H200)", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [
        f"- copy bandwidth (read+write): {copy['GBps']:.0f} GB/s ({copy['bytes'] / 2**30:.0f} GiB copy, {copy['ms']:.3f} ms)",
        "",
    ]
    lines += [
        "| batch x ctx | path | ms | GB/s | % copy bw | x vs unfused | overhead vs raw | host us/call |",
        "|---|---|---|---|---|---|---|---|",
    ]
    checks = []
    for r in dec:
        if "ms" not in r:
            checks.append(r)
            continue
        gbps = f"{r['GBps']:.0f}" if "GBps" in r else "-"
        pct = f"{r['pct_copy']:.1f} ({r['pct_copy_best']:.1f})" if "pct_copy" in r else "-"
        ovh = f"{r['overhead_vs_raw_pct']:+.1f}%" if "overhead_vs_raw_pct" in r else ""
        lines.append(
            f"| {r['batch']} x {r['ctx']} | {r['path']} | {r['ms']:.4f} ({r['ms_min']:.4f}..{r['ms_max']:.4f}) | {gbps} | {pct} | {r['x_vs_unfused']:.1f} | {ovh} | {r['host_us']:.0f} |"
        )
    lines += ["", "Output agreement (relative Frobenius error):", ""]
    for c in checks:
        lines += [
            f"- {c['batch']} x {c['ctx']}: "
            + ", ".join(f"{k} {v:.2e}" for k, v in c.items() if isinstance(v, float))
        ]
    lines += [
        "",
        "## Prefill throughput per layer (causal, fa2)",
        "",
        "| batch x len | cache | ms | tokens/s | TFLOP/s |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['batch']} x {r['len']} | {r['cache']} | {r['ms']:.3f} | {r['tokens_per_s']:.3g} | {r['TFLOPs']:.0f} |"
        for r in pre
    ]
    lines += [
        "",
        "## Plan cost per batch (forward_context entry, host, synchronized)",
        "",
        "| batch x ctx | kernel | us |",
        "|---|---|---|",
    ]
    lines += [
        f"| {r['batch']} x {r['ctx']} | {r['kernel']} | {r['plan_us_median']:.0f} |" for r in plans
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per path")
    args = ap.parse_args()
    env = environment()
    copy = copy_bandwidth()
    dec = []
    for batch, ctx in ((64, 4096), (32, 16384), (8, 1024)):
        dec += decode_case(batch, ctx, copy["GBps"], args.rounds)
    pre = prefill_case(4, 4096)
    plans = plan_cost(32, 16384)
    data = {"env": env, "copy": copy, "decode": dec, "prefill": pre, "plan": plans}
    write_results("bench_decode_attention", data, markdown(env, copy, dec, pre, plans))


if __name__ == "__main__":
    main()
