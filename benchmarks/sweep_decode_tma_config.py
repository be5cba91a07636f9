"""The TMA decode's loop configuration per cache kind on one GPU: (warps, stages, pages per
iteration, lazy rescale) at 32 x 16k, FP8 per tensor beside the per-(token, head) modes, each a
CUDA graph of 20 calls, rounds interleaved over every configuration, median. Checks whether the
per-(token, head) caches want another ``decode_tma.TUNED`` entry than FP8 per tensor's.

    python benchmarks/sweep_decode_tma_config.py [llama] [gemma_global]   # a line per (cache, config)
"""

from __future__ import annotations

import itertools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONFIGS = [(1, s, p, lazy) for s, p, lazy in itertools.product((4, 6, 8), (1, 2), (True, False))]
KEYS = ("num_warps", "num_stages", "pages_per_iter", "lazy_rescale")


def sweep_shape(shape: str, copy_gbps: float) -> None:
    """Every (cache, config) of ``shape`` at 32 x 16k: one printed line each."""
    from bench_fp8_decode_paths import K_SCALE, V_SCALE, Case
    from bench_kv_write import graph_ms

    from torch_kvq.attention.triton.decode_tma import paged_decode_tma, tuned

    c = Case(shape, 32, 16384)
    caches = {"fp8_per_tensor": (c.cache8, None, K_SCALE, V_SCALE, c.kv_bytes)}
    for mode in ("int8", "fp8"):
        codes, scales = c.per_token_head(mode)
        caches[f"{mode}_per_token_head"] = (codes, scales, 1.0, 1.0, getattr(c, f"bytes_{mode}"))
    out = torch.empty_like(c.q)
    calls: dict[tuple, Callable[[], None]] = {}
    for name, cfg in itertools.product(caches, CONFIGS):
        cache, sc, ks, vs, _ = caches[name]
        kw = dict(zip(KEYS, cfg))
        calls[(name, cfg)] = lambda cache=cache, sc=sc, ks=ks, vs=vs, kw=kw: paged_decode_tma(
            c.q, cache, c.table, c.seq_lens, ks, vs, c.sm_scale, max_seq_len=c.ctx, out=out,
            kv_scale=sc, **kw,
        )  # fmt: skip
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
        mark = " (tuned)" if dict(zip(KEYS, cfg)) == tuned(c.d) else ""
        print(
            f"{shape} {name} {dict(zip(KEYS, cfg))}: {ms:.4f} ms {pct:.1f}% copy{mark}", flush=True
        )


def main() -> None:
    from gpu_common import copy_bandwidth

    copy = copy_bandwidth()["GBps"]
    for shape in sys.argv[1:] or ("llama", "gemma_global"):
        sweep_shape(shape, copy)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
