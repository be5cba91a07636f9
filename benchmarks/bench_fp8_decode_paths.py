"""FP8-KV decode attention paths on one GPU: speed against copy bandwidth, error against fp32.

Per layer, one new token per sequence, NHD pages of 16, bf16 queries, pages shuffled. Shapes:
Llama-3.1-8B (QH32 KH8 D128) at 32 x 16k (all paths, Triton sweep, XQA bimodality study), 32 x 4k
and 64 x 16k; Gemma-3-12B's global layer (QH16 KH8 D256, no window) at 32 x 16k. Paths:
  fi_tc_bf16 / fi_tc_fp8[...]   BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, fa2),
                                default plan and each plan knob (fixed_split_size, disable_split_kv)
  fi_cc_fp8                     the same wrapper with use_tensor_cores=False (CUDA-core decode)
  xqa_fp8                       trtllm_batch_decode_with_kv_cache(backend="xqa") (FP8 math on sm90)
  xqa_generic                   flashinfer.xqa.xqa forced onto mha.cu (bf16 math; the Python API
                                always picks the FP8 Hopper kernel for an FP8 cache on sm90)
  fi_fa3_fp8kv                  (--fa3 only) fa3 backend with bf16 q, fp8 kv: expected to fail
  triton[...]                   torch_kvq's split-K kernel, a sweep of its parameters
Each time: CUDA graph of ``--calls`` calls, replayed once per round, rounds interleaved across
paths; median, min, max over rounds, plus per-call times (eager, one event pair per call) to
expose two modes. "% copy" is bytes of K+V read / time over the measured device-to-device copy
bandwidth (read + write). rel err: Frobenius, against fp32 dense attention on the dequantized
cache the path read. A path that cannot run gets a row with its error, never a substitute.

    python benchmarks/bench_fp8_decode_paths.py --quick    # ~2-3 min on an H200
    python benchmarks/bench_fp8_decode_paths.py --sliding-study --rounds 5   # one study alone

The studies (``--<name>-study``) live in ``fp8_decode_studies.py``; this module holds the shapes,
the paths and the timing they share.
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

    def __init__(self, name: str, batch: int, ctx: int, sorted_pages: bool = False) -> None:
        self.name, self.batch, self.ctx = name, batch, ctx
        self.qh, self.kh, self.d = SHAPES[name]
        self.per_seq = -(-ctx // PAGE)
        pages = batch * self.per_seq
        gen = torch.Generator().manual_seed(0)
        perm = torch.arange(pages) if sorted_pages else torch.randperm(pages, generator=gen)
        self.table = perm.view(batch, self.per_seq).to(torch.int32).cuda()
        self.kv_indices = self.table.flatten().contiguous()
        self.kv_indptr = (torch.arange(batch + 1, dtype=torch.int32) * self.per_seq).cuda()
        last = ctx - (self.per_seq - 1) * PAGE
        self.last_page_len = torch.full((batch,), last, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.cache8 = random_cache(pages, PAGE, self.kh, self.d, FP8, 16.0)
        self.cache16: torch.Tensor | None = None
        self.q = torch.randn(batch, self.qh, self.d, device="cuda", dtype=BF16)
        self.sm_scale = self.d**-0.5
        self.kv_bytes = batch * ctx * self.kh * self.d * 2  # FP8 K + V
        self.ref8 = self.reference(self.cache8, K_SCALE, V_SCALE)

    def bf16_cache(self) -> torch.Tensor:
        if self.cache16 is None:
            pages = self.batch * self.per_seq
            self.cache16 = random_cache(pages, PAGE, self.kh, self.d, BF16, 1.0)
            self.ref16 = self.reference(self.cache16, 1.0, 1.0)
        return self.cache16

    def reference(self, cache: torch.Tensor, ks: float, vs: float) -> torch.Tensor:
        """fp32 dense attention, 4 sequences at a time (bounded memory)."""
        out = torch.empty(self.batch, self.qh, self.d, device="cuda")
        g = self.qh // self.kh
        for s in range(0, self.batch, 4):
            pages = cache[self.table[s : s + 4].long()]  # [b, n, 2, page, KH, D]
            b = pages.shape[0]
            k = pages[:, :, 0].reshape(b, -1, self.kh, self.d)[:, : self.ctx].float() * ks
            v = pages[:, :, 1].reshape(b, -1, self.kh, self.d)[:, : self.ctx].float() * vs
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
    c: Case, kv: torch.dtype, tc: bool, backend: str = "fa2", q_dtype: torch.dtype = BF16,
    o_dtype: torch.dtype | None = None, **plan_kw: Any,
) -> Callable:  # fmt: skip
    """``q_dtype`` fp16: the query is cast per call (timed with it) and the math runs in fp16."""
    import flashinfer

    # fixed split sizes need more than 256 MiB of split-k scratch at 32 x 16k
    ws = torch.zeros(1024 * 2**20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_tensor_cores=tc, backend=backend
    )
    w.plan(
        c.kv_indptr, c.kv_indices, c.last_page_len, c.qh, c.kh, c.d, PAGE,
        q_data_type=q_dtype, kv_data_type=kv, o_data_type=o_dtype or q_dtype, sm_scale=c.sm_scale,
        **plan_kw,
    )  # fmt: skip
    out = torch.empty(c.q.shape, dtype=o_dtype or q_dtype, device="cuda")
    if kv == FP8 and q_dtype != BF16:
        return lambda: w.run(c.q.to(q_dtype), c.cache8, out=out, k_scale=K_SCALE, v_scale=V_SCALE)
    if kv == FP8:
        return lambda: w.run(c.q, c.cache8, out=out, k_scale=K_SCALE, v_scale=V_SCALE)
    cache = c.bf16_cache()
    return lambda: w.run(c.q, cache, out=out)


def fi_graph_mode_fixed_split(c: Case, split_pages: int) -> Callable:
    """The wrapper as CUDA-graph engines build it (use_cuda_graph=True) with a fixed split."""
    import flashinfer

    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    bufs = (c.kv_indptr.clone(), c.kv_indices.clone(), c.last_page_len.clone())
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, backend="fa2",
        paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1],
        paged_kv_last_page_len_buffer=bufs[2],
    )  # fmt: skip
    w.plan(
        c.kv_indptr, c.kv_indices, c.last_page_len, c.qh, c.kh, c.d, PAGE, q_data_type=BF16,
        kv_data_type=FP8, o_data_type=BF16, sm_scale=c.sm_scale, fixed_split_size=split_pages,
    )  # fmt: skip
    return lambda: w.run(c.q, c.cache8, k_scale=K_SCALE, v_scale=V_SCALE)


def xqa_official(c: Case) -> Callable:
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(c.q)
    return lambda: trtllm_batch_decode_with_kv_cache(
        c.q, c.cache8, ws, c.table, c.seq_lens, c.ctx, out=out,
        bmm1_scale=K_SCALE * c.sm_scale, bmm2_scale=V_SCALE, kv_layout="NHD", backend="xqa",
    )  # fmt: skip


def xqa_direct(
    c: Case, generic: bool = False, sm_count: int | None = None, pdl: bool | None = None,
    zero_semaphores: bool = False, q_dtype: torch.dtype = BF16,
) -> Callable:  # fmt: skip
    """flashinfer.xqa.xqa with its knobs: ``generic`` forces mha.cu (bf16 math) by wrapping the
    JIT module so its first argument (run_sm90_fp8_mha) is False; ``zero_semaphores`` clears the
    8 MiB semaphore area before every call (the time then includes that memset, a few us)."""
    import importlib

    # the package's `xqa` attribute is the function (flashinfer/__init__ re-exports it)
    fx = importlib.import_module("flashinfer.xqa")

    k, v = c.cache8.unbind(1)
    out = torch.empty(c.q.shape, dtype=q_dtype, device="cuda").unsqueeze(1)
    q = c.q.to(q_dtype).unsqueeze(1)
    seq = c.seq_lens.unsqueeze(1)
    ws = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    kw = dict(q_scale=K_SCALE * c.sm_scale / V_SCALE * c.d**0.5, kv_scale=V_SCALE)
    if sm_count is not None:
        kw["sm_count"] = sm_count
    if pdl is not None:
        kw["enable_pdl"] = pdl

    def call() -> torch.Tensor:
        if zero_semaphores:
            ws[: 8 * 2**20].zero_()
        fx.xqa(q, k, v, c.table, seq, out, ws[8 * 2**20 :], ws[: 8 * 2**20], c.kh, PAGE, **kw)
        return out.squeeze(1)

    if not generic:
        return call
    real = fx.get_xqa_module

    def forced_module(*args: Any, **kwargs: Any) -> Any:
        mod = real(*args, **kwargs)

        class Forced:
            @staticmethod
            def xqa(run_sm90_fp8_mha: bool, *rest: Any, **kw2: Any) -> Any:
                return mod.xqa(False, *rest, **kw2)

        return Forced

    def generic_call() -> torch.Tensor:
        fx.get_xqa_module = forced_module
        try:
            return call()
        finally:
            fx.get_xqa_module = real

    return generic_call


def triton_path(c: Case, **kw) -> Callable:
    from torch_kvq.attention.kernels.triton_decode import paged_decode_fp8

    out = torch.empty_like(c.q)
    return lambda: paged_decode_fp8(
        c.q, c.cache8, c.kv_indptr, c.kv_indices, c.seq_lens, K_SCALE, V_SCALE, c.sm_scale,
        max_seq_len=c.ctx, out=out, **kw,
    )  # fmt: skip


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
    base = {"shape": c.name, "batch": c.batch, "ctx": c.ctx}
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


TRITON_CFG: dict[str, dict[str, Any]] = {}  # path name -> paged_decode_fp8 keyword args


def triton_paths(c: Case, cfgs: list[dict[str, Any]]) -> dict[str, Callable]:
    out = {}
    for kw in cfgs:
        name = "triton[bn{block_n},w{num_warps},st{num_stages},s{num_splits}".format(**kw)
        if "qk_dtype" in kw:
            name += ",qk " + str(kw["qk_dtype"]).removeprefix("torch.")
        name += "]"
        TRITON_CFG[name] = kw
        out[name] = lambda kw=kw: triton_path(c, **kw)
    return out


def triton_sweep(c: Case, copy_gbps: float, quick: bool, calls: int) -> list[dict[str, Any]]:
    """Tiling at the default split count (s None), then the split count at the best tiling."""
    grid = [(bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
    if quick:
        grid = [(bn, w, st) for bn in (64, 128) for w in (4, 8) for st in (2, 3)]
    cfgs = [dict(block_n=bn, num_warps=w, num_stages=st, num_splits=None) for bn, w, st in grid]
    rows = measure(c, triton_paths(c, cfgs), copy_gbps, 3, calls, "ref8")
    best = TRITON_CFG[min((r for r in rows if "ms" in r), key=lambda r: r["ms"])["path"]]
    splits = (1, 2, 4, 8, 16) if quick else (1, 2, 3, 4, 6, 8, 12, 16)
    cfgs = [{**best, "num_splits": s} for s in splits]
    return rows + measure(c, triton_paths(c, cfgs), copy_gbps, 3, calls, "ref8")


def allocation_study(c: Case, paths: dict[str, Callable], trials: int) -> list[dict[str, Any]]:
    """Run-to-run modes: the same call on fresh copies of the cache at new addresses."""
    rows = []
    for name, make in paths.items():
        per_trial = []
        for i in range(trials):
            pad = torch.empty((i * 37 + 1) * 2**20, dtype=torch.uint8, device="cuda")
            c.cache8 = torch.empty_like(c.cache8).copy_(c.cache8)
            t = Timed(make(), 20)
            for _ in range(3):
                t.round()
            per_trial.append(statistics.median(t.rounds))
            del pad
        rows.append({"shape": c.name, "batch": c.batch, "ctx": c.ctx, "path": name,
                     "trial_ms": per_trial, "per_call": modes(per_trial)})  # fmt: skip
    return rows


# -- JIT builds, report, main ------------------------------------------------------------------


def start_builds() -> threading.Thread:
    """Compile the FlashInfer modules the paths need, concurrently, in the background."""

    def run() -> None:
        from flashinfer.jit.attention.modules import gen_batch_decode_module
        from flashinfer.jit.xqa import gen_xqa_module

        from torch_kvq.attention.kernels.flashinfer_jit import build

        mods = {}
        for qh, kh, d in SHAPES.values():
            js = gen_xqa_module(BF16, FP8, PAGE, d, qh // kh, False, BF16, 1, False)
            mods[js.name] = js
            js = gen_batch_decode_module(BF16, FP8, BF16, torch.int32, d, d, 0, False, False)
            mods[js.name] = js
        try:
            build(mods, max_workers=len(mods))
        except Exception:  # noqa: BLE001 - the paths that need a module report its failure
            traceback.print_exc(limit=3)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def markdown(env: dict, copy: dict, rows: list[dict]) -> str:
    lines = ["## FP8-KV decode attention paths per layer", ""]
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
        if "trial_ms" in r:
            lines.append(
                f"{head} trials {', '.join(f'{x:.4f}' for x in r['trial_ms'])} | | | | | {md} |"
            )
            continue
        lines.append(
            f"{head} {r['ms']:.4f} ({r['ms_min']:.4f}..{r['ms_max']:.4f}) | {r['pct_copy']:.1f} | "
            f"{r['bound_ms']:.4f} | {r['rel_err']:.2e} | {pc['p10']:.4f}/{pc['p50']:.4f}/"
            f"{pc['p90']:.4f} | {md}{' (' + r['note'] + ')' if 'note' in r else ''} |"
        )
    return "\n".join(lines) + "\n"


def tma_path(c: Case, kernel: Any = None, **kw) -> Callable:
    """``kernel``: a module with ``paged_decode_tma`` (default: the package's)."""
    from torch_kvq.attention.triton import decode_tma as triton_decode_tma

    paged_decode_tma = (kernel or triton_decode_tma).paged_decode_tma
    out = torch.empty_like(c.q)
    return lambda: paged_decode_tma(
        c.q, c.cache8, c.table, c.seq_lens, K_SCALE, V_SCALE, c.sm_scale,
        max_seq_len=c.ctx, out=out, **kw,
    )  # fmt: skip


def main() -> None:
    from fp8_decode_studies import STUDIES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller Triton sweep, fewer trials")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="calls per timed graph")
    ap.add_argument("--fa3", action="store_true", help="also try fa3 with bf16 q + fp8 kv")
    for name, (_, what) in STUDIES.items():
        ap.add_argument(f"--{name}-study", action="store_true", help=f"only {what}")
    args = ap.parse_args()
    chosen = [study for name, (study, _) in STUDIES.items() if getattr(args, f"{name}_study")]
    if len(chosen) > 1:
        ap.error("one --<name>-study at a time")
    env, copy = environment(), copy_bandwidth()

    def save_rows(rows: list[dict[str, Any]]) -> None:
        write_results("bench_fp8_decode_paths", {"env": env, "copy": copy, "rows": rows},
                      markdown(env, copy, rows))  # fmt: skip

    if chosen:
        chosen[0](copy["GBps"], args.rounds, args.calls, save_rows)
        return
    builds = start_builds()
    gbps, rows = copy["GBps"], []

    main_case = Case("llama", 32, 16384)
    rows += triton_sweep(main_case, gbps, args.quick, args.calls)
    ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    best = [TRITON_CFG[r["path"]] for r in ok[:3]]  # the 3 fastest go on to every shape
    builds.join()

    def paths_for(c: Case, full: bool) -> dict[str, Callable]:
        p: dict[str, Callable] = {
            "fi_tc_bf16": lambda: fi_wrapper(c, BF16, True),
            "fi_tc_fp8": lambda: fi_wrapper(c, FP8, True),
            "xqa_fp8": lambda: xqa_official(c),
            "xqa_generic": lambda: xqa_direct(c, generic=True),
            "fi_cc_fp8": lambda: fi_wrapper(c, FP8, False),
            "triton[default]": lambda: triton_path(c),
        }
        p.update(triton_paths(c, best))
        if full:
            for sp in (32, 64, 128, 256):  # pages per split: 512 .. 4096 tokens
                p[f"fi_tc_fp8[fixed_split={sp}]"] = lambda sp=sp: fi_wrapper(
                    c, FP8, True, fixed_split_size=sp
                )
            p["fi_tc_fp8[disable_split_kv]"] = lambda: fi_wrapper(
                c, FP8, True, disable_split_kv=True
            )
            p["fi_tc_fp8[graph_mode,fixed_split=128]"] = lambda: fi_graph_mode_fixed_split(c, 128)
            p["xqa_fp8[sm_count=528]"] = lambda: xqa_direct(c, sm_count=528)
            p["xqa_fp8[sm_count=1056]"] = lambda: xqa_direct(c, sm_count=1056)
            p["xqa_generic[sm_count=528]"] = lambda: xqa_direct(c, generic=True, sm_count=528)
            if args.fa3:
                p["fi_fa3_fp8kv"] = lambda: fi_wrapper(c, FP8, True, backend="fa3")
        return p

    rows += measure(main_case, paths_for(main_case, True), gbps, args.rounds, args.calls, "ref8")

    def save() -> None:  # after every phase: a run cut short keeps what it measured
        write_results("bench_fp8_decode_paths", {"env": env, "copy": copy, "rows": rows},
                      markdown(env, copy, rows))  # fmt: skip

    save()
    # XQA bimodality: workspace, PDL, page order, allocation
    study = {
        "xqa_fp8[direct]": lambda: xqa_direct(main_case),
        "xqa_fp8[pdl=False]": lambda: xqa_direct(main_case, pdl=False),
        "xqa_fp8[semaphores zeroed per call]": lambda: xqa_direct(main_case, zero_semaphores=True),
    }
    rows += measure(main_case, study, gbps, args.rounds, args.calls, "ref8")
    sorted_case = Case("llama", 32, 16384, sorted_pages=True)
    srt = {"xqa_fp8[sorted pages]": lambda: xqa_direct(sorted_case),
           "triton[default,sorted pages]": lambda: triton_path(sorted_case),
           "fi_tc_fp8[sorted pages]": lambda: fi_wrapper(sorted_case, FP8, True)}  # fmt: skip
    rows += measure(sorted_case, srt, gbps, args.rounds, args.calls, "ref8")
    alloc = {
        "xqa_fp8": lambda: xqa_direct(main_case),
        "triton[default]": lambda: triton_path(main_case),
    }
    try:
        rows += allocation_study(main_case, alloc, 4 if args.quick else 8)
    except Exception as e:  # noqa: BLE001 - recorded; the shapes below still run
        rows.append({"path": "allocation study", "error": repr(e)[:300]})
    save()

    for name, b, ctx in (("llama", 32, 4096), ("llama", 64, 16384), ("gemma_global", 32, 16384)):
        c = Case(name, b, ctx)
        rows += measure(c, paths_for(c, False), gbps, args.rounds, args.calls, "ref8")
        save()


if __name__ == "__main__":
    # run as the module ``bench_fp8_decode_paths``, the one fp8_decode_studies imports (one copy
    # of its state, e.g. TRITON_CFG, not two)
    import bench_fp8_decode_paths

    bench_fp8_decode_paths.main()
