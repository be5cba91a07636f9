"""Llama's head-128 FP8 decode read as Gemma's head 256: two kv heads per program.

The TMA kernel reads Gemma-3's head-256 FP8 pages at 100-104% of copy bandwidth and Llama's
head-128 pages at 93-98% (runs 35-47 of 2026-12-01): per byte, head 128 pays twice the softmax
work, loop iterations and copy-engine requests. Two adjacent kv heads of a page are one
contiguous [page, 2 * D] box of the cache, so the cache seen as ``[pages, 2, page, KH / 2, 2D]``
is a valid head-256 cache. A block-diagonal query makes the head-256 kernel compute the right
thing: for kv-head pair j, the query rows of kv head 2j hold their query in columns ``:D`` and
zeros after, the rows of 2j + 1 zeros then their query in ``D:``; so each row's logits are its
own head's, and of its output row it keeps the half of its own head (the other half is the
other head's V under this row's weights, discarded). Same tensor-core work per byte as today
(the group of 4 query rows is padded to 16 either way), half the rest.

Here the query is built and the output picked by four copies per call (timed with the kernel);
in a kernel of its own they would be masked loads and stores.

Runs 55-58 (H200, 2026-12-01): level with the tuned kernel at 96-110 sequences (98.7% against
98.4% of copy bandwidth at 110 x 16k), slower below; replayed for 3 s both settle at the 700 W
cap at ~92% (a copy holds 100% at 625 W). Not taken into the package.

    python benchmarks/bench_pair_heads.py --rounds 5   # H200: $OUT/bench_pair_heads.json
    python benchmarks/bench_pair_heads.py --batches 110 --sustain-s 3   # speed at the power cap
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pair_views(q: torch.Tensor, cache: torch.Tensor, kv_heads: int) -> tuple[Any, ...]:
    """(block-diagonal query buffer [B, QH, 2D], the cache as [pages, 2, page, KH/2, 2D], fill,
    pick): ``fill()`` writes q into the buffer, ``pick(out2, out)`` writes each row's half."""
    b, qh, d = q.shape
    g = qh // kv_heads
    q2 = torch.zeros(b, qh, 2 * d, dtype=q.dtype, device=q.device)
    q2v, qv = q2.view(b, kv_heads // 2, 2, g, 2 * d), q.view(b, kv_heads // 2, 2, g, d)
    cache2 = cache.view(*cache.shape[:3], kv_heads // 2, 2 * d)

    def fill() -> None:
        q2v[:, :, 0, :, :d].copy_(qv[:, :, 0])
        q2v[:, :, 1, :, d:].copy_(qv[:, :, 1])

    def pick(out2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        o2, o = out2.view(b, kv_heads // 2, 2, g, 2 * d), out.view(b, kv_heads // 2, 2, g, d)
        o[:, :, 0].copy_(o2[:, :, 0, :, :d])
        o[:, :, 1].copy_(o2[:, :, 1, :, d:])
        return out

    return q2, cache2, fill, pick


def pair_path(c: Any, **kw: Any) -> Callable[[], torch.Tensor]:
    """The package's TMA kernel on the pair view of ``c``'s FP8 cache, copies included."""
    from bench_fp8_decode_paths import K_SCALE, V_SCALE

    from torch_kvq.attention.triton.decode_tma import paged_decode_tma

    q2, cache2, fill, pick = pair_views(c.q, c.cache8, c.kh)
    out2, out = torch.empty_like(q2), torch.empty_like(c.q)

    def run() -> torch.Tensor:
        fill()
        paged_decode_tma(q2, cache2, c.table, c.seq_lens, K_SCALE, V_SCALE, c.sm_scale,
                         max_seq_len=c.ctx, out=out2, **kw)  # fmt: skip
        return pick(out2, out)

    return run


def second_half(c: dict[str, Any]) -> dict[str, Any]:
    """Of a ``ClockSampler.summary()``: the median SM clock, the memory clocks seen and the median
    power over the second half of the samples, and the share of samples at the power cap (or the
    summary itself, when it has none)."""
    if not c.get("n"):
        return {"clocks": c}
    late = [x for x in c["samples"] if x[0] >= c["samples"][-1][0] / 2]
    return {
        "sm_mhz_median_second_half": statistics.median(x[1] for x in late),
        "mem_mhz_second_half": sorted({x[2] for x in late}),
        "power_w_median_second_half": statistics.median(x[3] for x in late),
        "power_cap_share": c["reasons_share"].get("sw_power_cap", 0.0),
    }


def back_to_back(step: Callable[[], object], reps: int) -> tuple[float, float, dict[str, Any]]:
    """``step`` ``reps`` times back to back under NVML sampling (every 5 ms): ms for all of them,
    ms for the second half (after the power cap has had time to act), ``second_half`` clocks."""
    from clock_sampler import ClockSampler

    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    torch.cuda.synchronize()
    with ClockSampler(every_s=0.005) as clocks:
        ev[0].record()
        for i in range(reps):
            step()
            if i + 1 == reps // 2:
                ev[1].record()
        ev[2].record()
        torch.cuda.synchronize()
    return ev[0].elapsed_time(ev[2]), ev[1].elapsed_time(ev[2]), second_half(clocks.summary())


def sustained(replay: Callable[[], object], calls: int, ms_per_call: float,
              seconds: float) -> dict[str, Any]:  # fmt: skip
    """A path's graph of ``calls`` calls (``ms_per_call`` each, measured) replayed for
    ``seconds``: time per call over the whole stretch and over its last half, with the clocks."""
    reps = max(2, int(seconds / (ms_per_call * calls * 1e-3)))
    total, late, clocks = back_to_back(replay, reps)
    row = {"reps": reps, "ms_per_call": total / (reps * calls),
           "ms_per_call_second_half": late / ((reps - reps // 2) * calls)}  # fmt: skip
    return {**row, **clocks}


def sustained_copy(seconds: float, nbytes: int = 2**31) -> dict[str, Any]:
    """``gpu_common.copy_bandwidth``'s copy for ``seconds``: GB/s (read + write) over the last
    half, with the clocks."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps = max(2, int(seconds / (2 * nbytes / 4.0e12)))
    _, late, clocks = back_to_back(lambda: dst.copy_(src), reps)
    gbps = 2 * nbytes * (reps - reps // 2) / (late * 1e-3) / 1e9
    return {"reps": reps, "GBps_second_half": gbps, **clocks}


def main() -> None:
    from bench_fp8_decode_paths import Case, Timed, markdown, measure, tma_path
    from gpu_common import copy_bandwidth, environment, write_results

    from torch_kvq.attention.triton import decode_tma as tma

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 48, 64, 80, 96, 110])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--sustain-s", type=float, default=0.0,
                    help="then replay the tuned path and the pairs at 2 splits and balanced 8 per "
                         "SM for this long each under NVML sampling (power-capped speed)")  # fmt: skip
    args = ap.parse_args()
    env, copy = environment(), copy_bandwidth()
    rows: list[dict[str, Any]] = []
    if args.sustain_s:
        rows.append({"path": "copy", "sustained": sustained_copy(args.sustain_s)})
        print("copy", rows[-1]["sustained"], flush=True)
    for batch in args.batches:
        c = Case("llama", batch, args.ctx)
        # what the models run: the tuned config, the schedule chosen by the package
        paths: dict[str, Callable] = {"tma[tuned]": lambda c=c: tma_path(c, **tma.tuned(128)),
                                      "tma[defaults]": lambda c=c: tma_path(c)}  # fmt: skip
        for splits in args.splits:
            kw = {**tma.tuned(256), "num_splits": splits}
            paths[f"pair[s{splits}]"] = lambda c=c, kw=kw: pair_path(c, **kw)
        for per_sm in (6, 8):
            kw = {**tma.tuned(256), "programs_per_sm": per_sm, "max_registers": None}
            paths[f"pair[balanced{per_sm}]"] = lambda c=c, kw=kw: pair_path(c, **kw)
        got = measure(c, paths, copy["GBps"], args.rounds, args.calls, "ref8")
        rows += got
        ms = {r["path"]: r["ms"] for r in got if "ms" in r}
        # tuned first and last: the board's temperature may drift over the stretches
        for name in ("tma[tuned]", "pair[s2]", "pair[balanced8]", "tma[tuned]") * (
            args.sustain_s > 0
        ):
            t = Timed(paths[name](), args.calls)
            got_s = sustained(t.graph.replay, args.calls, ms[name], args.sustain_s)
            rows.append({"shape": c.name, "batch": batch, "ctx": c.ctx, "path": name,
                         "sustained": got_s})  # fmt: skip
            print(batch, name, rows[-1]["sustained"], flush=True)
        timed = [r for r in rows if "sustained" not in r]
        write_results("bench_pair_heads", {"env": env, "copy": copy, "rows": rows},
                      markdown(env, copy, timed))  # fmt: skip
        del c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
