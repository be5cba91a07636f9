"""The package's quantized-KV decode attention paths per layer on one GPU: speed against copy
bandwidth, error against fp32.

One new token per sequence, NHD pages of 16, bf16 queries, pages shuffled, at 16k context.
Shapes: Llama-3.1-8B (QH 32, KH 8, D 128) and Gemma-3-12B's global layer (QH 16, KH 8, D 256),
each at batch 32 and at the largest batch its model fits on an H200 with FP8 KV (110 / 131
sequences, ``bench_decode_at_scale.py``). Paths, as ``FlashInferKernel`` runs them:
  fi_tc_bf16                 the tensor-core decode wrapper on a bf16 cache (a skipped layer)
  fi_tc_fp8                  the same wrapper on the FP8 cache, fp16 math (``fp8_decode_math``
                             "fp16", the default: the query cast per call, timed with it)
  fi_tc_fp8[bf16 math]       ``fp8_decode_math="model"``
  xqa_fp8                    ``fp8_decode="xqa"``: FlashInfer's XQA, FP8 math on sm90, PDL off
  triton_tma                 ``fp8_decode="triton"``: torch_kvq's TMA split-K decode at its
                             defaults (tuned config; split grid or balanced schedule, its choice)
  triton_int8_per_token_head the same kernel on an ``int8_per_token_head`` cache (int8 codes, one
                             fp32 scale per token and kv head), as FlashInferKernel decodes it
  triton_fp8_per_token_head  ... on an ``fp8_per_token_head`` cache (e4m3 codes, fp32 scales)
  triton_int4_per_token_head ... on an ``int4_per_token_head`` cache (two rotated codes per byte,
                             fp32 scales holding the zero point), read in place (the kernel
                             rotates q and un-rotates its output)
  triton_k8v4_per_token_head ... on a ``k8v4_per_token_head`` cache (k int8 in two slots, v int4
                             rotated in a third), read in place (the output un-rotated)
Each path: a CUDA graph of ``--calls`` calls, replayed once per round, rounds interleaved across
paths; median, min, max over rounds, plus per-call times (one event pair per call) to expose two
modes. "% copy" is bytes of K+V read (codes and scales: the per-(token, head) caches' fp32 scales
count; int4: D / 2 code bytes + 4 scale bytes per (token, kv head) for k and for v; k8v4: D + D / 2
+ 8) / time over
the measured device-to-device copy bandwidth (read + write). rel err: Frobenius, against fp32
dense attention on the dequantized cache the path read (the per-(token, head) caches hold the
bf16 cache's values quantized; int4's and k8v4's v dequantized and un-rotated). A path that
cannot run gets a
row with its error, never a substitute.

    python benchmarks/bench_fp8_decode_paths.py           # every shape (bash scripts/gpu_run.sh paths)
    python benchmarks/bench_fp8_decode_paths.py --quick   # batch 32 only
    python benchmarks/bench_fp8_decode_paths.py --quick --paths fi_tc_bf16,triton_tma,triton_int8_per_token_head,triton_fp8_per_token_head
    python benchmarks/bench_fp8_decode_paths.py --quick --paths triton_int8_per_token_head,triton_int4_per_token_head
    python benchmarks/bench_fp8_decode_paths.py --quick --paths triton_int8_per_token_head,triton_int4_per_token_head,triton_k8v4_per_token_head
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_common import copy_bandwidth, environment, random_cache, write_results  # noqa: E402

PAGE, BF16, FP8 = 16, torch.bfloat16, torch.float8_e4m3fn
K_SCALE = V_SCALE = 1 / 16  # stored ~N(0, 16), real ~N(0, 1)
SHAPES = {"llama": (32, 8, 128), "gemma_global": (16, 8, 256)}  # QH, KH, D


class Case:
    """Caches (FP8 and bf16), page tables, queries and fp32 references for one shape."""

    def __init__(self, name: str, batch: int, ctx: int, page: int = PAGE) -> None:
        self.name, self.batch, self.ctx, self.page = name, batch, ctx, page
        self.qh, self.kh, self.d = SHAPES[name]
        self.per_seq = -(-ctx // page)
        pages = batch * self.per_seq
        gen = torch.Generator().manual_seed(0)
        perm = torch.randperm(pages, generator=gen)
        self.table = perm.view(batch, self.per_seq).to(torch.int32).cuda()
        self.kv_indices = self.table.flatten().contiguous()
        self.kv_indptr = (torch.arange(batch + 1, dtype=torch.int32) * self.per_seq).cuda()
        last = ctx - (self.per_seq - 1) * page
        self.last_page_len = torch.full((batch,), last, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.cache8 = random_cache(pages, self.page, self.kh, self.d, FP8, 16.0)
        self.cache16: torch.Tensor | None = None
        self.q = torch.randn(batch, self.qh, self.d, device="cuda", dtype=BF16)
        self.sm_scale = self.d**-0.5
        self.kv_bytes = batch * ctx * self.kh * self.d * 2  # FP8 K + V
        self.ref8 = self.reference(self.cache8, K_SCALE, V_SCALE)

    def bf16_cache(self) -> torch.Tensor:
        if self.cache16 is None:
            pages = self.batch * self.per_seq
            self.cache16 = random_cache(pages, self.page, self.kh, self.d, BF16, 1.0)
            self.ref16 = self.reference(self.cache16, 1.0, 1.0)
        return self.cache16

    def per_token_head(self, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The bf16 cache quantized per (token, head) (``mode`` "int8" | "fp8" | "int4" |
        "k8v4"): codes and scales [pages, 2, KH, page]; its fp32 reference and bytes (codes +
        scales) set as attributes. int4: packed codes [pages, 2, page, KH, D / 2] uint8 (rotated,
        MSE-clipped: ``quant.quantize_int4_rotated``), D / 2 code bytes per (token, kv head);
        k8v4: [pages, 3, page, KH, D / 2] uint8 (``quant.quantize_k8v4_pages``), D + D / 2."""
        from torch_kvq.attention.quant import quantize_pages_per_token_head

        cache16 = self.bf16_cache()
        pages = cache16.shape[0]
        dtype = {"int8": torch.int8, "fp8": FP8}.get(mode, torch.uint8)
        packed = mode in ("int4", "k8v4")
        width = self.d // 2 if packed else self.d
        slots = 3 if mode == "k8v4" else 2
        codes = torch.empty((pages, slots, *cache16.shape[2:-1], width), dtype=dtype, device="cuda")
        scales = torch.empty(pages, 2, self.kh, self.page, device="cuda")
        step = 1024 if packed else 4096  # int4 tries 11 clip ratios: more temporaries
        for i in range(0, pages, step):
            x = cache16[i : i + step]
            c, s = quantize_pages_per_token_head(x, mode)
            codes[i : i + step], scales[i : i + step] = c, s.transpose(-1, -2)  # s [n, 2, page, KH]
        ref = self.reference(codes, 1.0, 1.0, scales)
        setattr(self, f"ref_{mode}", ref)
        code_bytes = self.kv_bytes * width * slots // (2 * self.d)
        setattr(self, f"bytes_{mode}", code_bytes + self.batch * self.ctx * self.kh * 2 * 4)
        return codes, scales

    def reference(
        self, cache: torch.Tensor, ks: float, vs: float, scales: torch.Tensor | None = None
    ) -> torch.Tensor:
        """fp32 dense attention, 4 sequences at a time (bounded memory); ``scales``: the
        per-(token, head) ones [pages, 2, KH, page] (a uint8 cache: int4, dequantized and
        un-rotated; with 3 slots k8v4, its v so)."""
        from torch_kvq.attention.quant import dequantize_int4_pages, dequantize_k8v4_pages

        out = torch.empty(self.batch, self.qh, self.d, device="cuda")
        g = self.qh // self.kh
        for s in range(0, self.batch, 4):
            ids = self.table[s : s + 4].long()
            if cache.dtype == torch.uint8 and cache.shape[1] == 3 and scales is not None:
                flat = ids.flatten()
                pages = dequantize_k8v4_pages(cache[flat], scales[flat].transpose(-1, -2))
                pages = pages.unflatten(0, ids.shape)
            elif cache.dtype == torch.uint8 and scales is not None:
                pages = dequantize_int4_pages(cache[ids], scales[ids].transpose(-1, -2))
            else:
                pages = cache[ids].float()  # [b, n, 2, page, KH, D]
            if scales is not None and cache.dtype != torch.uint8:
                pages = pages * scales[ids].transpose(-1, -2)[..., None]
            b = pages.shape[0]
            k = pages[:, :, 0].reshape(b, -1, self.kh, self.d)[:, : self.ctx] * ks
            v = pages[:, :, 1].reshape(b, -1, self.kh, self.d)[:, : self.ctx] * vs
            q = self.q[s : s + 4].float().view(b, self.kh, g, self.d)
            logits = torch.einsum("bhgd,blhd->bhgl", q, k) * self.sm_scale
            out[s : s + 4] = torch.einsum("bhgl,blhd->bhgd", logits.softmax(-1), v).reshape(
                b, self.qh, self.d
            )
        return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# -- paths ------------------------------------------------------------------------------------


def fi_wrapper(
    c: Case, kv: torch.dtype, q_dtype: torch.dtype = BF16, o_dtype: torch.dtype | None = None
) -> Callable:
    """FlashInfer's tensor-core decode wrapper (fa2). ``q_dtype`` fp16: the query is cast per call
    (timed with it) and the math runs in fp16."""
    import flashinfer

    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_tensor_cores=True, backend="fa2"
    )
    w.plan(
        c.kv_indptr, c.kv_indices, c.last_page_len, c.qh, c.kh, c.d, c.page,
        q_data_type=q_dtype, kv_data_type=kv, o_data_type=o_dtype or q_dtype, sm_scale=c.sm_scale,
    )  # fmt: skip
    out = torch.empty(c.q.shape, dtype=o_dtype or q_dtype, device="cuda")
    if kv == FP8 and q_dtype != BF16:
        return lambda: w.run(c.q.to(q_dtype), c.cache8, out=out, k_scale=K_SCALE, v_scale=V_SCALE)
    if kv == FP8:
        return lambda: w.run(c.q, c.cache8, out=out, k_scale=K_SCALE, v_scale=V_SCALE)
    cache = c.bf16_cache()
    return lambda: w.run(c.q, cache, out=out)


def xqa_path(c: Case) -> Callable:
    """flashinfer.xqa.xqa as ``FlashInferKernel(fp8_decode="xqa")`` calls it (PDL off)."""
    import importlib

    # the package's `xqa` attribute is the function (flashinfer/__init__ re-exports it)
    fx = importlib.import_module("flashinfer.xqa")

    k, v = c.cache8.unbind(1)
    out = torch.empty_like(c.q).unsqueeze(1)
    seq = c.seq_lens.unsqueeze(1)
    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    kw = dict(q_scale=K_SCALE * c.sm_scale / V_SCALE * c.d**0.5, kv_scale=V_SCALE, enable_pdl=False)

    def call() -> torch.Tensor:
        fx.xqa(c.q.unsqueeze(1), k, v, c.table, seq, out, ws[8 * 2**20 :], ws[: 8 * 2**20], c.kh,
               c.page, **kw)  # fmt: skip
        return out.squeeze(1)

    return call


def tma_path(c: Case) -> Callable:
    """The package's TMA split-K decode at its defaults (``FlashInferKernel(fp8_decode="triton")``)."""
    from torch_kvq.attention.triton.decode_tma import paged_decode_tma

    out = torch.empty_like(c.q)
    return lambda: paged_decode_tma(
        c.q, c.cache8, c.table, c.seq_lens, K_SCALE, V_SCALE, c.sm_scale,
        max_seq_len=c.ctx, out=out,
    )  # fmt: skip


def tma_per_token_head_path(c: Case, mode: str) -> Callable:
    """The TMA decode on a per-(token, head) cache as ``FlashInferKernel`` runs it: bf16 query,
    fp16 products (the kernel's default ``dot_dtype``), per-tensor scales 1.0."""
    from torch_kvq.attention.triton.decode_tma import paged_decode_tma

    codes, scales = c.per_token_head(mode)
    out = torch.empty_like(c.q)
    return lambda: paged_decode_tma(
        c.q, codes, c.table, c.seq_lens, 1.0, 1.0, c.sm_scale,
        max_seq_len=c.ctx, out=out, kv_scale=scales,
    )  # fmt: skip


PATHS: dict[str, Callable[[Case], Callable]] = {
    "fi_tc_bf16": lambda c: fi_wrapper(c, BF16),
    "fi_tc_fp8": lambda c: fi_wrapper(c, FP8, q_dtype=torch.float16, o_dtype=BF16),
    "fi_tc_fp8[bf16 math]": lambda c: fi_wrapper(c, FP8),
    "xqa_fp8": xqa_path,
    "triton_tma": tma_path,
    "triton_int8_per_token_head": lambda c: tma_per_token_head_path(c, "int8"),
    "triton_fp8_per_token_head": lambda c: tma_per_token_head_path(c, "fp8"),
    "triton_int4_per_token_head": lambda c: tma_per_token_head_path(c, "int4"),
    "triton_k8v4_per_token_head": lambda c: tma_per_token_head_path(c, "k8v4"),
}
# (shape, batch) at 16k: 32 sequences, and the largest batch each model fits with FP8 KV
CASES = [("llama", 32), ("gemma_global", 32), ("llama", 110), ("gemma_global", 131)]


# -- timing -----------------------------------------------------------------------------------


class Timed:
    """A path: graph of ``calls`` calls if it captures (else eager, said in the row)."""

    def __init__(self, fn: Callable, calls: int) -> None:
        self.fn, self.calls, self.note = fn, calls, ""
        self.out = fn()
        torch.cuda.synchronize()
        self.graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph):
                for _ in range(calls):
                    fn()
            self.graph.replay()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - recorded in the row
            self.graph, self.note = None, f"eager timing (graph capture failed: {e!r:.120})"
            torch.cuda.synchronize()
        self.rounds: list[float] = []

    def round(self) -> None:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            for _ in range(self.calls):
                self.fn()
        e.record()
        torch.cuda.synchronize()
        self.rounds.append(s.elapsed_time(e) / self.calls)

    def per_call(self, n: int) -> list[float]:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        ev[0].record()
        for i in range(n):
            self.fn()
            ev[i + 1].record()
        torch.cuda.synchronize()
        return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]


def modes(ms: list[float]) -> dict[str, Any]:
    """Per-call spread; two modes when the sorted times jump by > 8% somewhere in the middle."""
    s = sorted(ms)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    res: dict[str, Any] = {"p10": q(0.1), "p50": q(0.5), "p90": q(0.9), "bimodal": False}
    gaps = [(s[i + 1] / s[i], i) for i in range(len(s) // 20, len(s) - len(s) // 20 - 1)]
    if gaps:
        ratio, i = max(gaps)
        if ratio > 1.08:
            lo, hi = s[: i + 1], s[i + 1 :]
            res.update(bimodal=True, low_frac=len(lo) / len(s))
            res.update(low_ms=statistics.median(lo), high_ms=statistics.median(hi))
    return res


def measure(
    c: Case, paths: dict[str, Callable], copy_gbps: float, rounds: int, calls: int, ref: str
) -> list[dict[str, Any]]:
    """Interleaved rounds over every path that builds; a path that fails gets an error row."""
    timed: dict[str, Timed] = {}
    rows: list[dict[str, Any]] = []
    base = {"shape": c.name, "batch": c.batch, "ctx": c.ctx, "page": c.page}
    for name, make in paths.items():
        try:
            timed[name] = Timed(make(), calls)
        except Exception as e:  # noqa: BLE001 - the row says why
            rows.append({**base, "path": name, "error": f"{e!r:.300}"})
            traceback.print_exc(limit=2)
    for _ in range(rounds):
        for t in timed.values():
            t.round()
    for name, t in timed.items():
        bf16_kv = name.split("[")[0].endswith("bf16")  # a bf16 cache (not a bf16 output)
        nbytes = 2 * c.kv_bytes if bf16_kv else c.kv_bytes
        ref_out = c.ref16 if bf16_kv else getattr(c, ref)
        if name.endswith("_per_token_head"):  # codes + scales, its own reference
            mode = name.split("_")[1]
            nbytes, ref_out = getattr(c, f"bytes_{mode}"), getattr(c, f"ref_{mode}")
        ms = statistics.median(t.rounds)
        row = {**base, "path": name, "ms": ms, "ms_min": min(t.rounds), "ms_max": max(t.rounds)}
        row["pct_copy"] = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbps
        row["bound_ms"] = nbytes / (copy_gbps * 1e9) * 1e3
        row["rel_err"] = rel(t.out, ref_out)
        row["per_call"] = modes(t.per_call(100))
        if t.note:
            row["note"] = t.note
        rows.append(row)
    return rows


# -- JIT builds, report, main ------------------------------------------------------------------


def start_builds(paths: list[str]) -> threading.Thread:
    """Compile the FlashInfer modules ``paths`` need, concurrently, in the background: XQA per
    shape, and the fa2 prefill kernel the tensor-core decode runs per (q, kv, out) dtype."""

    def run() -> None:
        from flashinfer.jit.attention.modules import gen_batch_prefill_module
        from flashinfer.jit.xqa import gen_xqa_module

        from torch_kvq.attention.kernels.flashinfer_jit import build

        F16, I32 = torch.float16, torch.int32
        mods = {}
        dtypes = {"fi_tc_fp8": (F16, FP8, BF16), "fi_tc_fp8[bf16 math]": (BF16, FP8, BF16),
                  "fi_tc_bf16": (BF16, BF16, BF16)}  # fmt: skip
        for qh, kh, d in SHAPES.values():
            specs = []
            if "xqa_fp8" in paths:
                specs.append(gen_xqa_module(BF16, FP8, PAGE, d, qh // kh, False, BF16, 1, False))
            for q, kv, o in (dtypes[p] for p in paths if p in dtypes):
                specs.append(
                    gen_batch_prefill_module("fa2", q, kv, o, I32, d, d, 0, False, False, False)
                )
            mods.update({js.name: js for js in specs})
        try:
            build(mods, max_workers=len(mods))
        except Exception:  # noqa: BLE001 - the paths that need a module report its failure
            traceback.print_exc(limit=3)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def markdown(env: dict, copy: dict, rows: list[dict]) -> str:
    lines = ["## Quantized-KV decode attention paths per layer", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- copy bandwidth (read+write): {copy['GBps']:.0f} GB/s", ""]
    lines += ["| shape | B x ctx | path | ms med (min..max) | % copy | bound ms | rel err | "
              "per call p10/p50/p90 | modes |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        head = f"| {r['shape']} | {r['batch']} x {r['ctx']} | {r['path']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:150]} | | | | | |")
            continue
        pc = r.get("per_call", {})
        md = (f"{pc['low_frac']:.0%} at {pc['low_ms']:.4f}, rest at {pc['high_ms']:.4f}"
              if pc.get("bimodal") else "one")  # fmt: skip
        lines.append(
            f"{head} {r['ms']:.4f} ({r['ms_min']:.4f}..{r['ms_max']:.4f}) | {r['pct_copy']:.1f} | "
            f"{r['bound_ms']:.4f} | {r['rel_err']:.2e} | {pc['p10']:.4f}/{pc['p50']:.4f}/"
            f"{pc['p90']:.4f} | {md}{' (' + r['note'] + ')' if 'note' in r else ''} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 32 only (not the largest batches)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="calls per timed graph")
    ap.add_argument("--paths", help=f"comma-separated subset of {list(PATHS)} (default: all)")
    ap.add_argument("--page", type=int, default=PAGE, help="tokens per cache page (XQA: 16 only)")
    args = ap.parse_args()
    chosen = list(PATHS) if not args.paths else args.paths.split(",")
    unknown = [p for p in chosen if p not in PATHS]
    if unknown:
        raise SystemExit(f"unknown paths {unknown}; expected some of {list(PATHS)}")
    env, copy = environment(), copy_bandwidth()
    builds = start_builds(chosen)
    rows: list[dict[str, Any]] = []
    builds.join()
    for name, batch in CASES:
        if args.quick and batch != 32:
            continue
        c = Case(name, batch, 16384, args.page)
        paths = {p: (lambda make=PATHS[p], c=c: make(c)) for p in chosen}
        rows += measure(c, paths, copy["GBps"], args.rounds, args.calls, "ref8")
        # after every shape: a run cut short keeps what it measured
        write_results("bench_fp8_decode_paths", {"env": env, "copy": copy, "rows": rows},
                      markdown(env, copy, rows))  # fmt: skip
        del c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
