"""The decode step's projections as skinny GEMMs: the library GEMMs (cuBLAS, what the models run,
and cuBLASLt, each on the weight as stored, [N, K], and laid out [K, N]) against a split-K Triton
GEMM, per shape, against copy bandwidth.

Each projection of both models at M = 32 and at the FP8 config's largest batch, each path over
tile and split choices where it has them, each call on a different copy of the weights (more bytes
than the 50 MiB L2), in a CUDA graph of ``--calls`` calls.

Run 47 (H200, 2026-12-01, ``--quick``): cuBLAS reads at 60% (o_proj, 12.5 us for 7.4 us of
bytes) to 94-98% (gate_up) of copy bandwidth at M = 32 and 68-90% at M = 110-131; this kernel
came within 0.3-3 us at M = 32 (one shape ahead: Gemma's gate_up, 57.8 against 59.4 us) and lost
by far at 110-131. In the models (runs 49-50, the partials' sum fused by Inductor into the next
kernel: torch_kvq at commit 41783a1, ``use_split_k``) both steps got slower; cuBLAS stays.
Run 61 (``--no-splitk``): the [K, N] layout (cuBLAS NN) and cuBLASLt take 4.9-9.0 us off a layer's
four projections (e.g. Gemma's gate_up at M = 32: 61.6 -> 58.6 us, 91 -> 95% of copy bandwidth).

    python benchmarks/bench_skinny_gemm.py                  # H200: writes $OUT/bench_skinny_gemm.json
    python benchmarks/bench_skinny_gemm.py --smoke          # CPU: Triton's interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (K, N) of each projection, fused as the headline runs fuse them (q/k/v, gate/up), and M values:
# batch 32 and the FP8 config's largest batch at 16k (runs 36-37)
SHAPES: dict[str, tuple[dict[str, tuple[int, int]], tuple[int, ...]]] = {
    "llama-3.1-8b": ({"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                      "down": (14336, 4096)}, (32, 110)),
    "gemma-3-12b": ({"qkv": (3840, 8192), "o": (4096, 3840), "gate_up": (3840, 30720),
                     "down": (15360, 3840)}, (32, 131)),
}  # fmt: skip
# --quick: a few configs spread over tile widths and splits
QUICK = [(32, 128, 4, 4), (32, 128, 8, 4), (32, 256, 8, 4), (64, 128, 2, 4), (64, 128, 4, 3),
         (64, 128, 8, 4), (64, 256, 2, 3), (64, 256, 4, 4), (128, 128, 2, 3), (128, 128, 1, 4)]  # fmt: skip
# (BLOCK_N, BLOCK_K, SPLIT_K, stages) tried per shape
CONFIGS = [(bn, bk, s, st) for bn, bk, s, st in itertools.product(
    (32, 64, 128), (128, 256), (1, 2, 4, 8), (3, 4)) if bn * bk <= 128 * 128]  # fmt: skip


def shapes(
    models: list[str], projections: list[str] | None, ms: list[int] | None
) -> Iterator[tuple[str, str, int, int, int]]:
    """(model, projection, K, N, M) for each projection of ``models`` (all, or those named) at
    each M (``ms``, or the model's defaults in ``SHAPES``)."""
    for model in models:
        projs, default_ms = SHAPES[model]
        for proj, (k, n) in projs.items():
            if projections and proj not in projections:
                continue
            for m in ms or default_ms:
                yield model, proj, k, n, m


def gemm_bytes(m: int, k: int, n: int) -> int:
    """Bytes a bf16 ``[m, k] @ [n, k]^T`` reads and writes once: weights, input, output."""
    return 2 * (n * k + m * k + m * n)


def splitk_linear(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, split_k: int,
                  stages: int) -> torch.Tensor:  # fmt: skip
    """``x [M, K] @ w [N, K]^T`` -> [M, N] in x's dtype: programs over (N tiles, K splits, M
    tiles of up to 128 rows), fp32 partials summed by a second kernel when ``split_k > 1``."""
    import triton
    from skinny_gemm_kernels import _reduce_splits, _splitk_mm

    m, k = x.shape
    n = w.shape[0]
    block_m = max(16, min(128, triton.next_power_of_2(m)))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = (
        torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    )
    grid = (triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))
    _splitk_mm[grid](
        x, w, part, m, n, k, x.stride(0), w.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, STAGES=stages,
        num_warps=4,
    )  # fmt: skip
    if split_k > 1:
        _reduce_splits[(triton.cdiv(m * n, 1024),)](part, out, m * n, SPLIT_K=split_k, BLOCK=1024)
    return out


def weights(k: int, n: int, device: str, min_bytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Copies of a [n, k] weight, enough of them to pass ``min_bytes`` (L2 is 50 MiB)."""
    copies = max(2, -(-min_bytes // (2 * n * k)))
    g = torch.Generator(device=device).manual_seed(0)
    return [(torch.randn((n, k), generator=g, device=device) * 0.02).to(dtype)
            for _ in range(copies)]  # fmt: skip


# the library GEMMs' path names (blas_paths)
BLAS = ("cublas", "cublaslt", "cublas_kn", "cublaslt_kn")  # fmt: skip


def with_blas(library: str, fn: Callable) -> Callable:
    """``fn`` run with torch's preferred BLAS library set to ``library`` ("cublas", "cublaslt"),
    the old preference restored after: a CUDA graph captures the library's kernel."""

    def run(*args: Any) -> Any:
        prev = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(library)
        try:
            return fn(*args)
        finally:
            torch.backends.cuda.preferred_blas_library(prev)

    return run


def blas_paths(
    x: torch.Tensor, libraries: tuple[str, ...] = ("cublas", "cublaslt")
) -> dict[str, tuple[Callable, bool]]:
    """The library GEMMs (a CPU build has only "cublas", its CPU BLAS): each library on the
    model's [N, K] weight (``F.linear``) and on the weight stored transposed, [K, N]
    (``x @ w_kn``); value: (fn, takes [K, N])."""
    linear = lambda w: F.linear(x, w)  # noqa: E731
    mm_kn = lambda w: torch.mm(x, w)  # noqa: E731
    paths = {lib: (with_blas(lib, linear), False) for lib in libraries}
    return paths | {f"{lib}_kn": (with_blas(lib, mm_kn), True) for lib in libraries}


def study(m: int, k: int, n: int, device: str, calls: int, rounds: int, configs, min_bytes: int,
          gbps: float | None, dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:  # fmt: skip
    """The library GEMMs (``blas_paths``) and each split-K config on one shape: ms per call and
    error against fp32 (the interpreter's bf16 ``tl.dot`` is broken: ``--smoke`` runs fp32)."""
    from bench_fp8_decode_paths import Timed

    ws = weights(k, n, device, min_bytes, dtype)
    ws_kn = [w.t().contiguous() for w in ws]
    x = torch.randn((m, k), device=device).to(dtype)
    ref = F.linear(x.float(), ws[0].float())
    paths = blas_paths(x, ("cublas", "cublaslt") if device == "cuda" else ("cublas",))
    for bn, bk, s, st in configs:
        paths[f"splitk[bn{bn},bk{bk},s{s},st{st}]"] = (
            lambda w, c=(bn, bk, s, st): splitk_linear(x, w, *c),
            False,
        )
    rows = []
    for name, (fn, kn) in paths.items():
        row: dict[str, Any] = {"m": m, "k": k, "n": n, "path": name}
        copies = ws_kn if kn else ws
        try:
            err = float((fn(copies[0]).float() - ref).norm() / ref.norm())
            if device == "cuda":
                it = itertools.cycle(copies)
                t = Timed(lambda fn=fn, it=it: fn(next(it)), calls)  # a new copy per call
                for _ in range(rounds):
                    t.round()
                row["ms"] = statistics.median(t.rounds)
                if gbps:
                    row["pct_copy"] = 100 * gemm_bytes(m, k, n) / (row["ms"] * 1e-3) / 1e9 / gbps
            row["rel_err"] = err
        except Exception as e:  # noqa: BLE001 - the row says why
            row["error"] = f"{e!r:.200}"
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--projections", nargs="+", help="default: all")
    ap.add_argument("--calls", type=int, default=24, help="calls per timed CUDA graph")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help=f"the {len(QUICK)} QUICK configs only")
    ap.add_argument("--no-splitk", action="store_true", help="the library GEMMs only")
    ap.add_argument("--ms", type=int, nargs="+",
                    help="rows (batch) to time; default 32 and the FP8 config's largest batch")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, no timing")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    if args.smoke:
        for m, k, n in ((5, 96, 80), (33, 256, 64)):
            cfgs = [(32, 64, 2, 2), (64, 128, 1, 2), (32, 32, 4, 2)]
            rows += study(m, k, n, "cpu", 1, 1, cfgs, 0, None, torch.float32)
        bad = [r for r in rows if "error" in r or r["rel_err"] > 2e-2]
        print(rows)
        if bad:
            raise SystemExit(f"smoke failed: {bad}")
        return
    from gpu_common import copy_bandwidth, environment, write_results

    env, gbps = environment(), copy_bandwidth()["GBps"]
    for model, proj, k, n, m in shapes(args.models, args.projections, args.ms):
        cfgs = [] if args.no_splitk else QUICK if args.quick else CONFIGS
        got = study(m, k, n, "cuda", args.calls, args.rounds, cfgs, 2**28, gbps)
        rows += [{"model": model, "proj": proj, **r} for r in got]
        best = min((r for r in got if "ms" in r), key=lambda r: r["ms"])
        libs = ", ".join(f"{r['path']} {r.get('ms', 0):.4f} ms {r.get('pct_copy', 0):.0f}%"
                         for r in got if r["path"] in BLAS)  # fmt: skip
        print(f"{model} {proj} M={m}: {libs}; best {best['path']} {best['ms']:.4f} ms "
              f"{best.get('pct_copy', 0):.0f}%", flush=True)  # fmt: skip
        write_results("bench_skinny_gemm", {"env": env, "copy_GBps": gbps, "rows": rows},
                      markdown(rows))  # fmt: skip


def markdown(rows: list[dict[str, Any]]) -> str:
    """Per shape: each library GEMM and the fastest split-K config."""
    lines = ["| model | proj | M | " + " | ".join(f"{b} ms / % copy" for b in BLAS)
             + " | best split-K | ms / % copy |", "|---" * (5 + len(BLAS)) + "|"]  # fmt: skip
    shapes = sorted({(r["model"], r["proj"], r["m"]) for r in rows}, key=str)
    for model, proj, m in shapes:
        got = [r for r in rows if (r["model"], r["proj"], r["m"]) == (model, proj, m) and "ms" in r]
        libs = [next((r for r in got if r["path"] == b), None) for b in BLAS]
        best = min((r for r in got if r["path"] not in BLAS), key=lambda r: r["ms"], default=None)
        fmt = lambda r: f"{r['ms']:.4f} / {r.get('pct_copy', 0):.0f}" if r else "-"  # noqa: E731
        lines.append(f"| {model} | {proj} | {m} | " + " | ".join(fmt(r) for r in libs)
                     + f" | {best['path'] if best else '-'} | {fmt(best)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
