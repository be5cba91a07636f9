"""The fused cache write per layer on one GPU: bytes moved per second against copy bandwidth.

One layer's new k / v [T, KH, D] (bf16) written into a paged cache (pages of 16) at shuffled slots
(``--slots tokens``) and in shuffled whole pages, as a prefill writes them (``pages``; a page's
scales then one run of 64 bytes per kv head, not scattered 4-byte stores), for every cache mode
the package writes:
  bf16                 ``write_kv`` into a bf16 cache (a skipped layer: no quantization)
  fp8_per_tensor       ``write_kv`` with static k / v scales (``kvq::quant_cache_write``)
  int8_per_token_head  ``write_kv_per_token_head``: absmax per (token, kv head), int8 codes
                       and fp32 scales (``kvq::quant_cache_write_per_token_head``)
  fp8_per_token_head   the same with e4m3 codes
  int4_per_token_head  the same, rotated, MSE-clipped asymmetric int4 (two codes per byte: D / 2
                       bytes per (token, head), plus the 4-byte scale holding the zero point)
  k8v4_per_token_head  k as int8_per_token_head (its bytes over two cache slots), v as
                       int4_per_token_head (a third slot): two launches
Shapes: Llama-3.1-8B (KH 8, D 128) and Gemma-3-12B's global layer (KH 8, D 256); T: decode batches
of 32 and 131 tokens, one 16k prompt, and 8 prompts of 16k (a prefill step). Each case: a CUDA
graph of ``--calls`` writes, replayed per round; median over rounds. "% copy" is (k / v bytes
read + codes and scales written + slots read) / time over the measured device-to-device copy
bandwidth (read + write); decode-sized writes are launch-bound, not bandwidth-bound.

    python benchmarks/bench_kv_write.py            # bash scripts/gpu_k32.sh
    python benchmarks/bench_kv_write.py --smoke    # CPU: the aten writes of one small case
    python benchmarks/bench_kv_write.py --modes bf16 int4_per_token_head   # some modes only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch_kvq.attention.v_layout import v_from_cache  # noqa: E402

PAGE = 16
SHAPES = {"llama": (8, 128), "gemma_global": (8, 256)}  # KH, D
TOKENS = (32, 131, 16384, 8 * 16384)
MODES = ("bf16", "fp8_per_tensor", "int8_per_token_head", "fp8_per_token_head",
         "int4_per_token_head", "k8v4_per_token_head")  # fmt: skip
SLOTS = ("tokens", "pages")  # new tokens at shuffled slots; in shuffled whole pages
CODE = {"bf16": torch.bfloat16, "fp8_per_tensor": torch.float8_e4m3fn,
        "int8_per_token_head": torch.int8, "fp8_per_token_head": torch.float8_e4m3fn,
        "int4_per_token_head": torch.uint8, "k8v4_per_token_head": torch.uint8}  # fmt: skip


@dataclass
class Write:
    """One layer's write: ``call`` writes the tokens into ``cache`` (and ``kv_scale``)."""

    call: Callable[[], None]
    nbytes: int  # k / v read, codes and scales written, slots read
    cache: torch.Tensor
    kv_scale: torch.Tensor | None


def make_write(
    mode: str, kh: int, d: int, tokens: int, device: str, slots: str = "tokens"
) -> Write:
    """A call writing ``tokens`` new tokens of one layer in ``mode``: at shuffled slots
    (``slots="tokens"``: each token anywhere in the pool), or, as a prefill fills them, in
    shuffled whole pages (``"pages"``: a page's tokens at its consecutive offsets)."""
    from torch_kvq.attention.kernels.kv_write import write_kv
    from torch_kvq.attention.kernels.kv_write_per_token_head import write_kv_per_token_head

    pages = -(-tokens * 5 // 4 // PAGE)  # a pool a quarter larger than the tokens
    gen = torch.Generator().manual_seed(tokens)
    if slots == "tokens":
        slot_ids = torch.randperm(pages * PAGE, generator=gen)[:tokens].to(device)
    else:
        order = torch.randperm(pages, generator=gen)[:, None] * PAGE + torch.arange(PAGE)
        slot_ids = order.reshape(-1)[:tokens].to(device)
    k, v = (torch.randn(tokens, kh, d, generator=gen).bfloat16().to(device) for _ in "kv")
    fmt = mode.split("_")[0]
    # (cache slots, elements a head): int4 two codes per byte; k8v4 k's D bytes in two slots
    dims, width = (3 if fmt == "k8v4" else 2), (d // 2 if fmt in ("int4", "k8v4") else d)
    cache = torch.zeros(pages, dims, PAGE, kh, width, dtype=CODE[mode], device=device)
    # k / v read in bf16, codes written (a row: int4 D / 2 bytes, k8v4 D + D / 2), slots read
    nbytes = 2 * tokens * kh * d * 2 + dims * tokens * kh * width * cache.element_size()
    nbytes += tokens * 8
    if mode.endswith("per_token_head"):
        kv_scale = torch.zeros(pages, 2, kh, PAGE, device=device)
        nbytes += 2 * tokens * kh * 4
        call = lambda: write_kv_per_token_head(cache, kv_scale, k, v, slot_ids, fmt)  # noqa: E731
        return Write(call, nbytes, cache, kv_scale)
    scales = (1 / 16, 1 / 8) if mode == "fp8_per_tensor" else None
    return Write(lambda: write_kv(cache, k, v, slot_ids, scales), nbytes, cache, None)


def graph_ms(fn: Callable, calls: int, rounds: int) -> list[float]:
    """Per-call ms of a CUDA graph of ``calls`` calls, one value per replayed round."""
    fn()  # compile, and the division probes, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    out = []
    for _ in range(rounds + 1):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) / calls)
    return out[1:]  # the first replay warms up


def markdown(env: dict, copy: dict, rows: list[dict]) -> str:
    lines = ["## Fused cache write per layer", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- copy bandwidth (read+write): {copy['GBps']:.0f} GB/s", ""]
    lines += ["| shape | tokens | slots | mode | ms med (min..max) | GB/s | % copy |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        head = f"| {r['shape']} | {r['tokens']} | {r.get('slots', 'tokens')} | {r['mode']} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:150]} | | |")
            continue
        lines.append(
            f"{head} {r['ms']:.4f} ({r['ms_min']:.4f}..{r['ms_max']:.4f}) | {r['GBps']:.0f} | "
            f"{r['pct_copy']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def smoke() -> None:
    """CPU: every mode's aten write on a small case writes the tokens it was given."""
    for mode, slots in ((m, p) for m in MODES for p in SLOTS):
        w = make_write(mode, 2, 64, 40, "cpu", slots)
        w.call()
        cache = w.cache
        if cache.dtype == torch.uint8:  # v's codes at their positions: back to a token a row
            cache = torch.cat((cache[:, :-1], v_from_cache(cache[:, -1:])), 1)
        written = cache.float().abs().amax(dim=(3, 4)).gt(0).sum()  # [pages, 2 / 3, page]
        if int(written) != w.cache.shape[1] * 40:
            raise SystemExit(
                f"smoke: {mode} ({slots}) wrote {int(written)} token slots of its "
                f"{w.cache.shape[1]} cache slots, not {w.cache.shape[1] * 40}"
            )
    print("smoke ok:", ", ".join(MODES))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="calls per timed graph")
    ap.add_argument("--max-tokens", type=int, default=max(TOKENS), help="skip larger cases")
    ap.add_argument("--smoke", action="store_true", help="CPU only: run the aten writes once")
    ap.add_argument("--slots", nargs="+", choices=SLOTS, default=list(SLOTS),
                    help="slot patterns: shuffled tokens, shuffled whole pages (a prefill's)")  # fmt: skip
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                    help="cache modes to measure (default: all)")  # fmt: skip
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    from gpu_common import copy_bandwidth, environment, write_results

    env, copy = environment(), copy_bandwidth()
    rows: list[dict[str, Any]] = []
    for shape, (kh, d) in SHAPES.items():
        for tokens, slots in ((t, p) for t in TOKENS if t <= args.max_tokens for p in args.slots):
            for mode in args.modes:
                base = {"shape": shape, "tokens": tokens, "slots": slots, "mode": mode}
                try:
                    w = make_write(mode, kh, d, tokens, "cuda", slots)
                    nbytes = w.nbytes
                    ms = graph_ms(w.call, args.calls if tokens < 16384 else 4, args.rounds)
                except Exception as e:  # noqa: BLE001 - the row says why
                    rows.append({**base, "error": f"{e!r:.300}"})
                    traceback.print_exc(limit=2)
                    continue
                med = statistics.median(ms)
                gbps = nbytes / (med * 1e-3) / 1e9
                rows.append({**base, "ms": med, "ms_min": min(ms), "ms_max": max(ms),
                             "bytes": nbytes, "GBps": gbps, "pct_copy": 100 * gbps / copy["GBps"]})  # fmt: skip
                w = None
                torch.cuda.empty_cache()
        write_results("bench_kv_write", {"env": env, "copy": copy, "rows": rows},
                      markdown(env, copy, rows))  # fmt: skip


if __name__ == "__main__":
    main()
