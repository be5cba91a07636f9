"""One TMA decode call at 32 x 16k for Nsight Compute (the 4-bit decodes' stalls: docs/design/
int4-branch.md, "Where the 4-bit decodes stall"). On the device machine:

    ncu -k regex:_decode_pages --launch-skip 2 --launch-count 1 \
      --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio' \
      python3 scripts/ncu_decode.py int4 llama [num_stages=4 ...]

MODE: int8 | fp8 | int4 | k8v4 (``bench_fp8_decode_paths.Case.per_token_head``), or tc4
(``decode_tc4_tma.paged_decode_tc4_tma`` over ``bench_decode_tc4.tc4_cache``; ``-k
regex:_decode_tc4_tma``); SHAPE: llama | gemma_global; then the decode's keyword arguments as
KEY=INT (``page=N``: N tokens a cache page, not an argument; default 16). Three calls: compile,
then two to skip."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    from bench_fp8_decode_paths import Case

    from torch_kvq.attention.triton.decode_tma import paged_decode_tma

    mode, shape = sys.argv[1], sys.argv[2]
    kw = {k: int(v) for k, v in (a.split("=") for a in sys.argv[3:])}
    c = Case(shape, 32, 16384, kw.pop("page", 16))
    if mode == "tc4":
        from bench_decode_tc4 import tc4_cache

        from torch_kvq.attention.triton.decode_tc4_tma import paged_decode_tc4_tma

        codes, aux = tc4_cache(c.batch * c.per_seq, c.page, c.kh, c.d)
        for _ in range(3):
            paged_decode_tc4_tma(
                c.q.half(), codes, aux, c.table, c.seq_lens, c.sm_scale, max_seq_len=c.ctx, **kw
            )
        torch.cuda.synchronize()
        return
    codes, scales = c.per_token_head(mode)
    for _ in range(3):
        paged_decode_tma(
            c.q, codes, c.table, c.seq_lens, 1.0, 1.0, c.sm_scale, max_seq_len=c.ctx,
            kv_scale=scales, **kw,
        )  # fmt: skip
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
