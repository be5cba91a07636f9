"""The TMA decode's loop configuration per cache kind on one GPU: (warps, stages, pages per
iteration, lazy rescale) at 32 x 16k (``--batches``: other batch sizes), FP8 per tensor beside
the per-(token, head) modes, each a CUDA graph of 20 calls, rounds interleaved over every
configuration, median. Checks whether the per-(token, head) caches want another
``decode_config.TUNED`` entry than FP8 per tensor's, and (``--max-registers``) whether a register
cap that holds more programs per SM pays.

    python benchmarks/sweep_decode_tma_config.py [llama] [gemma_global]   # a line per (cache, config)
    python benchmarks/sweep_decode_tma_config.py llama --caches int4_per_token_head --max-registers 0 168
    python benchmarks/sweep_decode_tma_config.py llama --caches k8v4_per_token_head --configs 1,4,1,1 1,6,1,1 --carveout 100
    python benchmarks/sweep_decode_tma_config.py llama --configs 1,6,1,1 --splits 0 4 6 --programs-per-sm 8 12
    python benchmarks/sweep_decode_tma_config.py llama --batches 197 --caches int4_per_token_head --splits 0 1 2
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIGS = [
    (1, s, p, lazy, None) for s, p, lazy in itertools.product((4, 6, 8), (1, 2), (True, False))
]
KEYS = (
    "num_warps", "num_stages", "pages_per_iter", "lazy_rescale", "kv_heads_per_program",
    "max_registers", "num_splits", "programs_per_sm",
)  # fmt: skip
CACHES = ("fp8_per_tensor", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head",
          "k8v4_per_token_head")  # fmt: skip


def sweep_shape(
    shape: str,
    copy_gbps: float,
    names: list[str],
    caps: list[int],
    configs: list[tuple],
    splits: list[int],
    page: int,
    carveout: int | None = None,
    programs_per_sm: tuple[int, ...] = (),
    batch: int = 32,
) -> None:
    """Every (cache, config, register cap, schedule) of ``shape`` at ``batch`` x 16k: a line each.
    The schedules: the split grid with each of ``splits`` (0: the default schedule, which is the
    balanced one where ``decode_config.default_schedule`` picks it, e.g. FP8 at 197 sequences), then
    the balanced schedule with each of ``programs_per_sm``."""
    from bench_fp8_decode_paths import K_SCALE, V_SCALE, Case
    from bench_kv_write import graph_ms

    from torch_kvq.attention.triton.decode_config import mode_cache_kind, tuned
    from torch_kvq.attention.triton.decode_tma import paged_decode_tma

    c = Case(shape, batch, 16384, page)
    caches = {}
    if "fp8_per_tensor" in names:
        caches["fp8_per_tensor"] = (c.cache8, None, K_SCALE, V_SCALE, c.kv_bytes)
    for mode in ("int8", "fp8", "int4", "k8v4"):
        if f"{mode}_per_token_head" in names:
            codes, scales = c.per_token_head(mode)
            nbytes = getattr(c, f"bytes_{mode}")
            caches[f"{mode}_per_token_head"] = (codes, scales, 1.0, 1.0, nbytes)
    out = torch.empty_like(c.q)
    calls: dict[tuple, Callable[[], None]] = {}
    schedules = [(n or None, None) for n in splits] + [(None, p) for p in programs_per_sm]
    for name, cfg, cap, sched in itertools.product(caches, configs, caps, schedules):
        cache, sc, ks, vs, _ = caches[name]
        cfg = (*cfg, cap, *sched)  # cap 0: no cap (None would take TUNED's)
        kw = dict(zip(KEYS, cfg))
        calls[(name, cfg)] = lambda cache=cache, sc=sc, ks=ks, vs=vs, kw=kw: paged_decode_tma(
            c.q, cache, c.table, c.seq_lens, ks, vs, c.sm_scale, max_seq_len=c.ctx, out=out,
            kv_scale=sc, **kw,
        )  # fmt: skip
    if carveout is not None:  # compile every config, then set the preference on each kernel
        for call in calls.values():
            call()
        print(f"{shape}: carveout {carveout}% on {set_carveout(carveout)} kernels", flush=True)
    times: dict[tuple, list[float]] = {k: [] for k in calls}
    for _ in range(3):  # interleaved rounds: the board's drift spreads over every config
        for key, call in calls.items():
            try:
                times[key] += graph_ms(call, 20, 1)
            except Exception as e:  # noqa: BLE001 - the line says why
                times[key] = [float("nan")]
                print(f"{shape} {key}: {e!r:.200}", flush=True)
    for (name, cfg), ts in times.items():
        ms = statistics.median(ts)
        pct = 100 * caches[name][4] / (ms * 1e-3) / 1e9 / copy_gbps
        default = {**tuned(c.d, mode_cache_kind(name), page=page), "num_splits": None,
                   "programs_per_sm": None}  # fmt: skip
        kw = dict(zip(KEYS, cfg))
        given = {**kw, "max_registers": kw["max_registers"] or None}
        mark = " (tuned)" if all(given[k] == v for k, v in default.items()) else ""
        at = f" batch {batch}" if batch != 32 else ""  # 32: the lines as before the option
        print(f"{shape}{at} page {page} {name} {kw}: {ms:.4f} ms {pct:.1f}% copy{mark}", flush=True)


def set_carveout(percent: int) -> int:
    """``cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT, percent)`` on every compiled
    ``_decode_pages`` kernel (Triton sets no carveout below 48 KB of shared memory, leaving the
    L1 / shared split to the driver: docs/design/int4-branch.md, thirteenth session, asks whether
    that split holds fewer programs per SM than registers allow). Returns how many were set."""
    import ctypes

    from torch_kvq.attention.triton.decode_tma import _decode_pages

    cuda = ctypes.CDLL("libcuda.so.1")
    n = 0
    for kernel_cache, *_ in _decode_pages.device_caches.values():
        for kernel in kernel_cache.values():
            kernel = kernel.result() if hasattr(kernel, "result") else kernel  # async compile
            kernel._init_handles()
            # 9: CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(kernel.function), 9, percent)
            if rc != 0:
                raise RuntimeError(f"cuFuncSetAttribute(carveout {percent}%): CUresult {rc}")
            n += 1
    return n


def main() -> None:
    from gpu_common import copy_bandwidth

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="*", default=["llama", "gemma_global"])
    ap.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES))
    ap.add_argument("--max-registers", nargs="+", type=int, default=[0],
                    help="Triton's maxnreg per config (0: none)")  # fmt: skip
    ap.add_argument("--splits", nargs="+", type=int, default=[0],
                    help="splits per (sequence, kv head) (0: the default schedule)")  # fmt: skip
    ap.add_argument("--programs-per-sm", nargs="+", type=int, default=[],
                    help="also the balanced schedule with this many programs per SM")  # fmt: skip
    ap.add_argument("--pages", nargs="+", type=int, default=[16], help="tokens per cache page")
    ap.add_argument("--batches", nargs="+", type=int, default=[32],
                    help="sequences of 16k tokens (the at-scale capacity of int4-recommended: 197)")  # fmt: skip
    ap.add_argument("--configs", nargs="+",
                    help="WARPS,STAGES,PPI,LAZY(0/1)[,KV_HEADS per program] (default: CONFIGS)")  # fmt: skip
    ap.add_argument("--carveout", type=int, choices=range(0, 101), metavar="PERCENT",
                    help="shared memory's share of L1 to prefer (default: the driver's choice)")  # fmt: skip
    args = ap.parse_args()
    configs = CONFIGS
    if args.configs:
        configs = [[int(x) for x in c.split(",")] + [None] for c in args.configs]
        configs = [(w, s, p, bool(lazy), nh) for w, s, p, lazy, nh, *_ in configs]
    copy = copy_bandwidth()["GBps"]
    for shape, page, batch in itertools.product(args.shapes, args.pages, args.batches):
        sweep_shape(shape, copy, args.caches, args.max_registers, configs, args.splits, page,
                    args.carveout, tuple(args.programs_per_sm), batch)  # fmt: skip
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
