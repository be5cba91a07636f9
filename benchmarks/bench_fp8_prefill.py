"""FP8-KV prefill per layer on the GPU (issue 14 item 3): which FlashInfer path beats bf16, and at
what error. NOT RUN YET (written 2026-11-30 without device time left; the first run will tell).

Per layer, ``--batch`` prompts of ``--len`` tokens each (default 8 x 16k: time to first token's
attention share), causal, paged NHD cache of page 16, pages shuffled, shapes Llama-3.1-8B (QH 32,
KH 8, D 128) and Gemma-3-12B's global layer (QH 16, KH 8, D 256). Paths:
  fa2_bf16         BatchPrefillWithPagedKVCacheWrapper(backend="fa2"), bf16 q + bf16 cache
  fa2_fp8kv        the same, bf16 q + FP8 cache read in place (what FlashInferKernel runs today)
  fa3_bf16         backend="fa3", bf16 q + bf16 cache
  fa3_fp8          backend="fa3", FP8 q + FP8 cache (q quantized per tensor: the time of that
                   quant is measured apart, ``q_quant``), bf16 output
Each: CUDA events over back-to-back calls (``time_per_call``), TFLOP/s (causal: half the square),
and the relative error of the last ``--check`` queries of every sequence against fp32 attention
on the same (dequantized) cache. A path that cannot run gets a row with its error.

    python benchmarks/bench_fp8_prefill.py                  # writes $OUT/bench_fp8_prefill.json
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import environment, random_cache, time_per_call, write_results  # noqa: E402

PAGE, BF16, FP8 = 16, torch.bfloat16, torch.float8_e4m3fn
KV_SCALE = 1 / 16  # stored ~N(0, 16), real ~N(0, 1)
SHAPES = {"llama": (32, 8, 128), "gemma_global": (16, 8, 256)}  # QH, KH, D


class Case:
    def __init__(self, shape: str, batch: int, length: int) -> None:
        self.qh, self.kh, self.d = SHAPES[shape]
        self.shape, self.batch, self.length = shape, batch, length
        per_seq = -(-length // PAGE)
        gen = torch.Generator().manual_seed(0)
        perm = torch.randperm(batch * per_seq, generator=gen).to(torch.int32)
        i32 = dict(dtype=torch.int32, device="cuda")
        self.table = perm.view(batch, per_seq).cuda()
        self.kv_indices = self.table.flatten().contiguous()
        self.kv_indptr = torch.arange(batch + 1, **i32) * per_seq
        self.qo_indptr = torch.arange(batch + 1, **i32) * length
        self.last = torch.full((batch,), length - (per_seq - 1) * PAGE, **i32)
        self.cache8 = random_cache(batch * per_seq, PAGE, self.kh, self.d, FP8, 16.0)
        self.cache16 = (self.cache8.float() * KV_SCALE).to(BF16)  # the same values, bf16
        self.q = torch.randn(batch * length, self.qh, self.d, device="cuda", dtype=BF16)
        self.q_scale = float(self.q.abs().amax()) / 448.0
        self.sm_scale = self.d**-0.5
        self.flops = 4 * self.d * self.qh * batch * length * (length + 1) / 2

    def reference(self, check: int) -> torch.Tensor:
        """fp32 attention of the last ``check`` queries of each sequence: [B, check, QH, D]."""
        g = self.qh // self.kh
        outs = []
        for b in range(self.batch):
            pages = self.table[b].long()
            kv = self.cache8[pages].float() * KV_SCALE  # [n, 2, page, KH, D]
            k = kv[:, 0].reshape(-1, self.kh, self.d)[: self.length]
            v = kv[:, 1].reshape(-1, self.kh, self.d)[: self.length]
            q = self.q[(b + 1) * self.length - check : (b + 1) * self.length].float()
            s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(g, 1)) * self.sm_scale
            pos_q = torch.arange(self.length - check, self.length, device="cuda")
            s.masked_fill_(
                torch.arange(self.length, device="cuda")[None, None] > pos_q[None, :, None],
                float("-inf"),
            )
            outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v.repeat_interleave(g, 1)))
        return torch.stack(outs)

    def tail(self, out: torch.Tensor, check: int) -> torch.Tensor:
        return out.view(self.batch, self.length, self.qh, self.d)[:, -check:].float()


def wrapper(c: Case, backend: str, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> Callable:
    import flashinfer

    ws = torch.zeros(512 * 2**20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(
        c.qo_indptr, c.kv_indptr, c.kv_indices, c.last, c.qh, c.kh, c.d, PAGE, causal=True,
        sm_scale=c.sm_scale, q_data_type=q_dtype, kv_data_type=kv_dtype, o_data_type=BF16,
    )  # fmt: skip
    out = torch.empty(c.q.shape, dtype=BF16, device="cuda")
    if kv_dtype == BF16:
        return lambda: w.run(c.q, c.cache16, out=out)
    if q_dtype == BF16:
        return lambda: w.run(c.q, c.cache8, k_scale=KV_SCALE, v_scale=KV_SCALE, out=out)
    q8 = (c.q.float() / c.q_scale).clamp(-448, 448).to(FP8)
    return lambda: w.run(q8, c.cache8, q_scale=c.q_scale, k_scale=KV_SCALE, v_scale=KV_SCALE,
                         out=out)  # fmt: skip


def build_modules(shapes: list[str]) -> None:
    """Every path's FlashInfer module, built concurrently up front (fa3 takes ~100 s each)."""
    from flashinfer.jit.attention.modules import gen_batch_prefill_module

    from torch_kvq.attention.kernels.flashinfer_jit import build

    mods = {}
    for shape in shapes:
        d = SHAPES[shape][2]
        for backend, q, kv in (("fa2", BF16, BF16), ("fa2", BF16, FP8), ("fa3", BF16, BF16),
                               ("fa3", FP8, FP8)):  # fmt: skip
            args = (backend, q, kv, BF16, torch.int32, d, d, 0, False, False, False)
            try:
                js = gen_batch_prefill_module(*args)
                mods[js.name] = js
            except Exception:  # noqa: BLE001 - that path's row will carry the error
                traceback.print_exc(limit=2)
    try:
        build(mods, max_workers=len(mods))
    except Exception:  # noqa: BLE001
        traceback.print_exc(limit=3)


def run_case(c: Case, check: int, iters: int) -> list[dict]:
    ref = c.reference(check)
    paths = {
        "fa2_bf16": lambda: wrapper(c, "fa2", BF16, BF16),
        "fa2_fp8kv": lambda: wrapper(c, "fa2", BF16, FP8),
        "fa3_bf16": lambda: wrapper(c, "fa3", BF16, BF16),
        "fa3_fp8": lambda: wrapper(c, "fa3", FP8, FP8),
    }
    rows = []
    for name, make in paths.items():
        row = {"shape": c.shape, "batch": c.batch, "len": c.length, "path": name}
        try:
            fn = make()
            out = fn()
            row.update(time_per_call(fn, iters=iters, warmup=2))
            row["TFLOPs"] = c.flops / (row["ms"] * 1e-3) / 1e12
            got = c.tail(out, check)
            row["rel_err"] = float((got - ref).norm() / ref.norm())
        except Exception as e:  # noqa: BLE001 - recorded, never replaced by another path
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        print(row, flush=True)
        rows.append(row)
    q_quant = time_per_call(lambda: (c.q.float() / c.q_scale).clamp(-448, 448).to(FP8), iters=iters)
    rows.append({"shape": c.shape, "batch": c.batch, "len": c.length, "path": "q_quant", **q_quant})
    base = next((r for r in rows if r["path"] == "fa2_bf16" and "ms" in r), None)
    for r in rows:
        if base and "ms" in r and r["path"] != "q_quant":
            r["x_vs_fa2_bf16"] = base["ms"] / r["ms"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--check", type=int, default=64, help="queries per sequence checked in fp32")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    env = environment()
    build_modules(args.shapes)
    rows: list[dict] = []
    for shape in args.shapes:
        rows += run_case(Case(shape, args.batch, args.len), args.check, args.iters)
    lines = [f"## FP8-KV prefill per layer ({env.get('gpu')}, {env['date_utc']})", "",
             "| shape | batch x len | path | ms | TFLOP/s | x vs fa2 bf16 | rel err |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ms = f"{r['ms']:.3f}" if "ms" in r else r.get("error", "")
        tf = f"{r['TFLOPs']:.0f}" if "TFLOPs" in r else ""
        x = f"{r['x_vs_fa2_bf16']:.2f}" if "x_vs_fa2_bf16" in r else ""
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else ""
        lines.append(
            f"| {r['shape']} | {r['batch']} x {r['len']} | {r['path']} | {ms} | {tf} | {x} | {err} |"
        )
    write_results("bench_fp8_prefill", {"env": env, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
