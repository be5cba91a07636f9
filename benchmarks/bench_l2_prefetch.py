"""Can a GEMM's fixed cost hide behind the small kernel before it? Prefetch part of its weight
into L2 on a side stream while an RMSNorm runs, then time RMSNorm + GEMM.

A decode step's skinny GEMMs each cost a few microseconds more than their bytes at copy
bandwidth (run 47: Gemma's four per layer 3.1-6.2 us each at M = 32), while the norm, GELU-mul
or merge kernel before each reads almost nothing. Here each call is ``rms_norm(x) @ w_i^T`` on
its own copy of the weight (more bytes than the 50 MiB L2), in a CUDA graph of ``--calls``
calls; the variants fork a side stream before the norm and prefetch, with
``cp.async.bulk.prefetch.L2`` (sm90), either the first bytes of ``w_i`` (``rows``: its first
output rows), the first columns of every row (``cols``: the K range each output tile reads
first), or all of it. The side stream joins once, at the end of the graph.

Run 52 (H200, 2026-12-01): the best of 17 variants saved 0-1.7 us per norm + GEMM (gate_up
most), no size or policy consistently; at most ~0.12 ms of Gemma's step: not adopted. A norm
before a GEMM cost 0.7-3.1 us more than the two timed apart.

    python benchmarks/bench_l2_prefetch.py            # H200: writes $OUT/bench_l2_prefetch.json
    python benchmarks/bench_l2_prefetch.py --ptx      # CPU: compile the prefetch kernel for sm90
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

_PREFETCH = {
    "normal": "@p cp.async.bulk.prefetch.L2.global [$1], $2;",
    "evict_last": "@p createpolicy.fractional.L2::evict_last.b64 pol, 1.0;\n\t"
    "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;",
}


@triton.jit
def _l2_prefetch(base, n_segs, seg_stride, seg_bytes, BLOCK: tl.constexpr, ASM: tl.constexpr):
    """One bulk L2 prefetch per thread: segment ``i`` = ``seg_bytes`` bytes at
    ``base + i * seg_stride`` (both multiples of 16), for i < n_segs."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ptrs = base.to(tl.pointer_type(tl.uint8)) + i.to(tl.int64) * seg_stride  # byte offsets
    size = tl.where(i < n_segs, seg_bytes, 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0;\n\t" + ASM + "\n\tmov.u32 $0, 0; }",
        "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


def prefetch(w: torch.Tensor, mode: str, nbytes: int, policy: str = "normal",
             chunk: int = 8192) -> None:  # fmt: skip
    """Prefetch ``nbytes`` of the row-major weight ``w [N, K]`` into L2: ``rows`` (its first
    bytes, in ``chunk``-byte pieces), ``cols`` (the first columns of every row) or ``all``."""
    n, k = w.shape
    row = k * w.element_size()
    if mode == "all":
        mode, nbytes = "rows", n * row
    if mode == "rows":
        seg_bytes, stride, segs = chunk, chunk, min(nbytes, n * row) // chunk
    elif mode == "cols":
        seg_bytes = min(row, max(16, nbytes // n)) // 16 * 16
        stride, segs = row, n
    else:
        raise ValueError(f"prefetch mode {mode!r}: expected 'rows', 'cols' or 'all'")
    block = 32
    grid = (triton.cdiv(segs, block),)
    _l2_prefetch[grid](w, segs, stride, seg_bytes, BLOCK=block, ASM=_PREFETCH[policy], num_warps=1)


def chain(xs: torch.Tensor, norm_w: torch.Tensor, ws: list[torch.Tensor], calls: int,
          pf: tuple[str, int, str] | None, side: torch.cuda.Stream) -> Callable[[], None]:  # fmt: skip
    """``calls`` times: [fork; prefetch w_i on the side stream]; rms_norm(x); x @ w_i^T."""
    main = torch.cuda.current_stream()

    def run() -> None:
        for i in range(calls):
            w = ws[i % len(ws)]
            if pf is not None:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    prefetch(w, *pf)
            F.linear(F.rms_norm(xs, (xs.shape[-1],), norm_w, 1e-6), w)
        if pf is not None:
            main.wait_stream(side)

    return run


def repeat(fn: Callable[[int], object], calls: int) -> None:
    """``fn(0)``, ..., ``fn(calls - 1)``."""
    for i in range(calls):
        fn(i)


def time_graph(fn: Callable[[], None], calls: int, rounds: int) -> list[float]:
    """us per call of a captured ``fn`` (itself ``calls`` calls), one value per replay."""
    from bench_fp8_decode_paths import Timed

    t = Timed(fn, 1)  # one capture of the whole chain, fork and join included
    if t.graph is None:
        raise RuntimeError(t.note)
    for _ in range(rounds):
        t.round()
    return [ms * 1e3 / calls for ms in t.rounds]


def study(m: int, k: int, n: int, calls: int, rounds: int, variants: list[tuple[str, int, str]],
          gbps: float) -> list[dict[str, Any]]:  # fmt: skip
    """Baseline, norm alone, GEMM alone and each prefetch variant on one shape."""
    from bench_skinny_gemm import gemm_bytes, weights

    ws = weights(k, n, "cuda", 2**28, torch.bfloat16)
    x = torch.randn((m, k), device="cuda").to(torch.bfloat16)
    nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    ideal_us = gemm_bytes(m, k, n) / gbps / 1e3
    cases: dict[str, Callable[[], None]] = {
        "norm+gemm": chain(x, nw, ws, calls, None, side),
        "gemm": lambda: repeat(lambda i: F.linear(x, ws[i % len(ws)]), calls),
        "norm": lambda: repeat(lambda i: F.rms_norm(x, (k,), nw, 1e-6), calls),
    }
    for v in variants:
        cases[f"pf[{v[0]},{v[1] >> 20}MiB,{v[2]}]"] = chain(x, nw, ws, calls, v, side)
    rows = []
    for name, fn in cases.items():
        us = time_graph(fn, calls, rounds)
        rows.append({"m": m, "k": k, "n": n, "case": name, "us": statistics.median(us),
                     "us_rounds": us, "gemm_ideal_us": ideal_us})  # fmt: skip
    base = rows[0]["us"]
    for r in rows:
        r["saved_us"] = base - r["us"] if r["case"].startswith("pf") else None
    return rows


def ptx_check() -> None:
    """Compile the prefetch kernel for sm90 with Triton's ptxas (no GPU needed)."""
    from triton.backends.compiler import GPUTarget

    sig = {"base": "*bf16", "n_segs": "i32", "seg_stride": "i64", "seg_bytes": "i32",
           "BLOCK": "constexpr", "ASM": "constexpr"}  # fmt: skip
    for policy, asm in _PREFETCH.items():
        src = triton.compiler.ASTSource(fn=_l2_prefetch, signature=sig,
                                        constexprs={"BLOCK": 32, "ASM": asm})  # fmt: skip
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
        assert "cp.async.bulk.prefetch.L2.global" in k.asm["ptx"], policy
        print(f"{policy}: cubin {len(k.asm['cubin'])} bytes")


def main() -> None:
    from bench_skinny_gemm import SHAPES, shapes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--projections", nargs="+", help="default: all")
    ap.add_argument("--ms", type=int, nargs="+", help="default: 32 and the largest batch")
    ap.add_argument("--mib", type=int, nargs="+", default=[4, 8, 16, 32], help="prefetch sizes")
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ptx", action="store_true", help="CPU: compile the kernel for sm90 only")
    args = ap.parse_args()
    if args.ptx:
        return ptx_check()
    from gpu_common import copy_bandwidth, environment, write_results

    env, gbps = environment(), copy_bandwidth()["GBps"]
    variants = [(mode, mib << 20, pol) for mode in ("rows", "cols") for mib in args.mib
                for pol in ("normal", "evict_last")] + [("all", 0, "normal")]  # fmt: skip
    rows: list[dict[str, Any]] = []
    for model, proj, k, n, m in shapes(args.models, args.projections, args.ms):
        got = study(m, k, n, args.calls, args.rounds, variants, gbps)
        rows += [{"model": model, "proj": proj, **r} for r in got]
        best = max(got[3:], key=lambda r: r["saved_us"])
        print(f"{model} {proj} M={m}: norm+gemm {got[0]['us']:.2f} us (gemm {got[1]['us']:.2f},"
              f" norm {got[2]['us']:.2f}, ideal {got[0]['gemm_ideal_us']:.2f}); best "
              f"{best['case']} {best['us']:.2f} (saved {best['saved_us']:.2f})", flush=True)  # fmt: skip
        write_results("bench_l2_prefetch", {"env": env, "copy_GBps": gbps, "rows": rows}, "")


if __name__ == "__main__":
    main()
