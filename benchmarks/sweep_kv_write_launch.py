"""The per-(token, head) cache write's launch on one GPU: values per program x warps, timed as
``bench_kv_write`` times a write (CUDA graph of 4 writes, median of 5 rounds), at a decode
step's 32 tokens and at the sizes where it is bandwidth-bound (shuffled tokens or whole pages).
Chooses ``kernels/kv_write_per_token_head.WRITE_ROW_ELEMENTS`` / ``WRITE_WARPS``.

    python benchmarks/sweep_kv_write_launch.py     # prints one line per (shape, tokens, mode, launch)
    python benchmarks/sweep_kv_write_launch.py --int4   # the int4 write at decode sizes: its
        # rows-first program (clip ratios side by side) on 1, 2 and 4 warps
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def int4_rows_first() -> None:
    """``kernels/kv_write_int4.rows_first_warps`` at a decode step's token counts (all
    ``ROWS_FIRST`` on an H200), one line per launch."""
    from bench_kv_write import SHAPES, graph_ms, make_write

    from torch_kvq.attention.kernels import kv_write_int4

    default = kv_write_int4.rows_first_warps
    for shape in ("llama", "gemma_global"):
        kh, d = SHAPES[shape]
        for tokens in (8, 32, 64):
            w = make_write("int4_per_token_head", kh, d, tokens, "cuda", "tokens")
            for warps in (1, 2, 4):
                kv_write_int4.rows_first_warps = lambda _d, n=warps: n
                us = 1e3 * statistics.median(graph_ms(w.call, 4, 5))
                mark = " (default)" if warps == default(d) else ""
                print(f"{shape} {tokens} tokens int4, {warps} warps: {us:.2f} us{mark}", flush=True)
            kv_write_int4.rows_first_warps = default
            del w
            torch.cuda.empty_cache()


def main() -> None:
    if "--int4" in sys.argv[1:]:
        return int4_rows_first()
    from bench_kv_write import SHAPES, graph_ms, make_write
    from gpu_common import copy_bandwidth

    from torch_kvq.attention.kernels import kv_write_per_token_head as write

    copy = copy_bandwidth()["GBps"]
    for shape in ("llama", "gemma_global"):
        kh, d = SHAPES[shape]
        for tokens, slots in (
            (32, "tokens"),
            (16384, "tokens"),
            (16384, "pages"),
            (131072, "pages"),
        ):
            for mode in ("int8_per_token_head", "fp8_per_token_head"):
                w = make_write(mode, kh, d, tokens, "cuda", slots)
                for elems in (kh * d, 2 * kh * d, 4096, 8192):
                    for warps in (2, 4, 8):
                        write.WRITE_ROW_ELEMENTS, write.WRITE_WARPS = elems, warps
                        ms = statistics.median(graph_ms(w.call, 4, 5))
                        pct = 100 * w.nbytes / (ms * 1e-3) / 1e9 / copy
                        print(
                            f"{shape} {tokens} {slots} {mode} elems {elems} warps {warps}: {ms:.4f} ms {pct:.1f}% copy",
                            flush=True,
                        )
                del w
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
