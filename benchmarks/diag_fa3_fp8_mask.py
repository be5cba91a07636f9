"""Diagnostic for fa3's FP8 prefill (FP8 query + FP8 cache) on FlashInfer 0.6.18: is the error the
finite mask sentinel? Written 2026-11-30 without device time; run on the H200 2026-12-01 (run 20:
every prediction below held; benchmarks/RESULTS.md).

Run 16's GPU gate found ``BatchPrefillWithPagedKVCacheWrapper(backend="fa3")`` with FP8 q and
cache 0.73 off on short prompts (QH 8, KH 2, D 128, page 16, sm_scale 0.05, k_scale 1/64,
v_scale 1/32), while run 15's 8 x 16k prompts (sm_scale 128**-0.5, k/v scale 1/16) were at 3.8e-2.
A source reading (``docs/fa3_fp8_mask_analysis.md``; FlashInfer issue #4267,
fixed by PR #4401 after 0.6.18) says: the FP8 mainloop masks the *raw code* logits q8.k8 with
``-math::inf`` = -5e4 (finite) and applies q_scale * k_scale * sm_scale only afterwards, so a
masked key's real logit is -5e4 * s with s = q_scale * k_scale * sm_scale, which is only about
-1.6 at the failing scales. Predictions this script checks, per row:

  * the error grows as k_scale (so s) shrinks, at fixed real values;
  * tiny codes (large scales: s large) pass at any length, garbage in unused slots or not;
  * full 128-multiple tiles fail too when causal (the diagonal tile is masked);
  * the workaround ``q_scale = max(amax / 448, 30 / (5e4 * k_scale * sm_scale))`` (so a masked key
    sits >= 30 below in real units) brings every failing row to FP8-level error (~4e-2).

    python benchmarks/diag_fa3_fp8_mask.py      # writes $OUT/diag_fa3_fp8_mask.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import environment, write_results  # noqa: E402

DEV, QH, KH, D, PAGE, E4 = "cuda", 8, 2, 128, 16, torch.float8_e4m3fn
SENTINEL = 5e4  # FlashInfer 0.6.18 include/flashinfer/math.cuh: math::inf


def quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(E4)


def case(qo: list[int], kv: list[int], ks: float, vs: float = 1 / 32, sm: float = 0.05,
         q_floor: bool = False, causal: bool = True, garbage: bool = True, seed: int = 0) -> dict:  # fmt: skip
    """One batch through fa3 FP8; rel err against fp32 on the same quantized values."""
    import flashinfer

    g = torch.Generator(device=DEV).manual_seed(seed)
    pages = [-(-n // PAGE) for n in kv]
    total = sum(pages)
    shape = (total + 8, 2, PAGE, KH, D)
    raw = (torch.randint(0, 126, shape, device=DEV, generator=g, dtype=torch.uint8) if garbage
           else torch.zeros(shape, device=DEV, dtype=torch.uint8))  # fmt: skip  # < 126: finite
    ids = torch.randperm(total + 8, device=DEV, generator=g)[:total].int()
    kv_indptr = torch.tensor([0, *pages], device=DEV).cumsum(0).int()
    qo_indptr = torch.tensor([0, *qo], device=DEV).cumsum(0).int()
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(kv, pages)], device=DEV).int()
    q = torch.randn(sum(qo), QH, D, device=DEV, generator=g)
    qs = float(q.abs().amax()) / 448
    if q_floor:
        qs = max(qs, 30.0 / (SENTINEL * ks * sm))
    q8, refs = quant(q, qs), []
    for b, (lq, lk) in enumerate(zip(qo, kv)):
        k8 = quant(torch.randn(lk, KH, D, device=DEV, generator=g), ks)
        v8 = quant(torch.randn(lk, KH, D, device=DEV, generator=g), vs)
        t = torch.arange(lk, device=DEV)
        pg = ids[kv_indptr[b] : kv_indptr[b + 1]].long()[t // PAGE]
        raw[pg, 0, t % PAGE] = k8.view(torch.uint8)
        raw[pg, 1, t % PAGE] = v8.view(torch.uint8)
        qq = q8[qo_indptr[b] : qo_indptr[b + 1]].float().transpose(0, 1) * qs  # [QH, lq, D]
        kk = (k8.float() * ks).repeat_interleave(QH // KH, 1).transpose(0, 1)
        vv = (v8.float() * vs).repeat_interleave(QH // KH, 1).transpose(0, 1)
        s = qq @ kk.transpose(1, 2) * sm
        if causal:
            future = t[None] > torch.arange(lq, device=DEV)[:, None] + lk - lq
            s.masked_fill_(future, float("-inf"))
        refs.append((s.softmax(-1) @ vv).transpose(0, 1))
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")
    w.plan(qo_indptr, kv_indptr, ids, last, QH, KH, D, PAGE, causal=causal, sm_scale=sm,
           q_data_type=E4, kv_data_type=E4, o_data_type=torch.bfloat16)  # fmt: skip
    out = torch.empty(sum(qo), QH, D, dtype=torch.bfloat16, device=DEV)
    w.run(q8, raw.view(E4), q_scale=qs, k_scale=ks, v_scale=vs, out=out)
    ref = torch.cat(refs)
    err = float((out.float() - ref).norm() / ref.norm())
    return {"qo": qo, "kv": kv, "k_scale": ks, "v_scale": vs, "sm_scale": sm, "q_scale": qs,
            "masked_real_logit": -SENTINEL * qs * ks * sm, "q_floor": q_floor, "causal": causal,
            "garbage": garbage, "rel_err": err}  # fmt: skip


def main() -> None:
    short = ([40, 130, 17], [40, 130, 17])
    mixed = ([1, 37, 50], [16, 137, 50])
    full = ([256, 256], [256, 256])
    rows = []
    for ks in (1 / 2, 1 / 16, 1 / 64, 1 / 256):
        rows += [case(*short, ks=ks), case(*mixed, ks=ks)]
    rows += [case(*full, ks=1 / 64), case(*full, ks=1 / 64, causal=False)]
    rows += [case(*short, ks=1 / 2, vs=1 / 2, sm=1.0, garbage=gb) for gb in (False, True)]
    rows += [case(*lens, ks=1 / 64, q_floor=True) for lens in (short, mixed, full)]
    rows += [case(*lens, ks=1 / 256, q_floor=True) for lens in (short, mixed)]
    lines = ["| qo | kv | k_scale | sm | q_scale | masked logit | floor | causal | garbage | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        print(r, flush=True)
        lines.append(
            f"| {r['qo']} | {r['kv']} | {r['k_scale']:.4g} | {r['sm_scale']} | {r['q_scale']:.3g} | "
            f"{r['masked_real_logit']:.3g} | {r['q_floor']} | {r['causal']} | {r['garbage']} | "
            f"{r['rel_err']:.3e} |"
        )
    write_results("diag_fa3_fp8_mask", {"env": environment(), "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
