"""The ``tc4_per_token_head`` decode per layer at 32 x 16k on one GPU (``triton/decode_tc4_tma.py``)
per splits, warps, stages and register cap, beside the tuned int4 decode (``decode_tma``) on the
same shape and pages: median ms of a CUDA graph of 20 calls, rounds interleaved, and % of copy
bandwidth counting code and scale bytes (tc4: 152 bytes a token and kv head at D 128, int4 136).
Answers issue 33's question of what tc4's formats cost a decode (docs/design/int4-branch.md).

    python benchmarks/bench_decode_tc4.py [llama] [gemma_global] [--page 32] [--splits 4 8]
        [--warps 1 4] [--stages 4 6] [--eager] [--max-registers 0 184] [--ctxs 8192 16384]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def tc4_cache(
    pages: int, page: int, kh: int, d: int, device: str = "cuda"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random code rows and valid side rows (fp16 scales in [0.01, 0.1], zero points mid-range):
    the decode's time does not depend on the values, and no scale is inf or NaN."""
    from torch_kvq.attention import quant_tc
    from torch_kvq.spec_modes import tc4_aux_width

    g = torch.Generator(device=device).manual_seed(0)
    codes = torch.randint(0, 256, (pages, 2, page, kh, d // 2), generator=g, device=device,
                          dtype=torch.uint8)  # fmt: skip
    records = torch.randint(0, 256, (pages, page, kh, tc4_aux_width(d)), generator=g,
                            device=device, dtype=torch.uint8)  # fmt: skip
    scales = (torch.rand(pages, page, kh, 5, generator=g, device=device) * 0.09 + 0.01).half()
    records[..., :10] = scales.view(torch.uint8)  # k's 3 scales, v's 2 (little-endian pairs)
    zps = torch.tensor([32, 8, 4, 16, 8, 0], dtype=torch.uint8, device=device)
    records[..., quant_tc.AUX_K_ZP : quant_tc.AUX_V_HIGH] = zps  # k's 3, v's 2, the pad byte
    aux = quant_tc.aux_to_cache(records)
    return codes, aux


def time_shape(
    shape: str,
    page: int,
    splits: list[int],
    warps: list[int],
    stages: list[int],
    eager: bool,
    regs: list[int],
    copy: float,
    ctx: int = 16384,
) -> None:
    """One line per decode of ``shape`` at 32 x ``ctx``: median ms and % of copy (tc4 per splits,
    warps, stages and register cap, 0 none as the launcher's default; lazy rescaling, and eager
    too with ``eager``)."""
    from bench_fp8_decode_paths import Case
    from bench_kv_write import graph_ms

    from torch_kvq.attention.triton.decode_tc4_tma import paged_decode_tc4_tma
    from torch_kvq.attention.triton.decode_tma import paged_decode_tma
    from torch_kvq.spec_modes import tc4_aux_width

    c = Case(shape, 32, ctx, page)
    int4_codes, int4_scales = c.per_token_head("int4")
    codes, aux = tc4_cache(c.batch * c.per_seq, page, c.kh, c.d)
    q = c.q.half()
    tc4_bytes = c.batch * c.ctx * c.kh * (c.d + tc4_aux_width(c.d))
    calls = {
        "int4 (tuned)": (c.bytes_int4, lambda: paged_decode_tma(
            c.q, int4_codes, c.table, c.seq_lens, 1.0, 1.0, c.sm_scale, max_seq_len=c.ctx,
            kv_scale=int4_scales)),
    }  # fmt: skip
    for s, w, st, r in itertools.product(splits, warps, stages, regs):
        for lazy in (True, False) if eager else (True,):
            name = f"tc4 splits {s} warps {w} stages {st} regs {r}{'' if lazy else ' eager'}"
            calls[name] = (tc4_bytes, lambda s=s, w=w, st=st, r=r, lazy=lazy:
                           paged_decode_tc4_tma(q, codes, aux, c.table, c.seq_lens, c.sm_scale,
                                                num_splits=s, num_warps=w, num_stages=st,
                                                lazy_rescale=lazy, max_registers=r))  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(3):  # interleaved rounds
        for name, (_, fn) in calls.items():
            times[name] += graph_ms(fn, 20, 1)
    for name, (nbytes, _) in calls.items():
        ms = statistics.median(times[name])
        pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy
        print(f"{shape} 32 x {ctx} page {page} {name}: {ms:.4f} ms, {pct:.1f}% copy", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="*", default=["llama"])
    ap.add_argument("--page", type=int, default=32)
    ap.add_argument("--splits", nargs="+", type=int, default=[8])
    ap.add_argument("--warps", nargs="+", type=int, default=[1])
    ap.add_argument("--stages", nargs="+", type=int, default=[6])
    ap.add_argument("--eager", action="store_true", help="also time eager rescaling")
    ap.add_argument("--ctxs", nargs="+", type=int, default=[16384],
                    help="tokens a sequence (several: the fixed cost is the intercept)")  # fmt: skip
    ap.add_argument("--max-registers", nargs="+", type=int, default=[0],
                    help="Triton's maxnreg (0: none, the launcher's default)")  # fmt: skip
    args = ap.parse_args()
    from gpu_common import copy_bandwidth, environment

    print(environment(), flush=True)
    copy = copy_bandwidth()["GBps"]
    for shape, ctx in itertools.product(args.shapes, args.ctxs):
        time_shape(
            shape,
            args.page,
            args.splits,
            args.warps,
            args.stages,
            args.eager,
            args.max_registers,
            copy,
            ctx,
        )


if __name__ == "__main__":
    main()
