"""The per-layer studies of ``bench_fp8_decode_paths.py`` (``--<name>-study``): each measures one
question about the FP8 decode paths at a few shapes and returns its rows. Run through that script,
e.g. ``python benchmarks/bench_fp8_decode_paths.py --sliding-study --rounds 5``."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_fp8_decode_paths import (
    BF16,
    FP8,
    PAGE,
    SHAPES,
    TRITON_CFG,
    Case,
    fi_wrapper,
    measure,
    tma_path,
    triton_path,
    triton_paths,
    xqa_direct,
)


def fp16_paths(c: Case) -> dict[str, Callable]:
    F16 = torch.float16
    p: dict[str, Callable] = {
        "fi_tc_bf16": lambda: fi_wrapper(c, BF16, True),
        "fi_tc_fp8": lambda: fi_wrapper(c, FP8, True),
        "fi_tc_fp8[q fp16, o fp16]": lambda: fi_wrapper(c, FP8, True, q_dtype=F16),
        "fi_tc_fp8[q fp16, o bf16]": lambda: fi_wrapper(c, FP8, True, q_dtype=F16, o_dtype=BF16),
        "xqa_fp8": lambda: xqa_direct(c, pdl=False),
        "xqa_generic": lambda: xqa_direct(c, generic=True),
        "xqa_generic[q fp16]": lambda: xqa_direct(c, generic=True, q_dtype=F16),
        "xqa_generic[q fp16, sm_count=528]": lambda: xqa_direct(
            c, generic=True, q_dtype=F16, sm_count=528
        ),
        "fi_cc_fp8[q fp16]": lambda: fi_wrapper(c, FP8, False, q_dtype=F16),
    }
    cfgs = [dict(block_n=bn, num_warps=w, num_stages=st, num_splits=sp, qk_dtype=qk)
            for qk in (BF16, F16) for bn, w, st in ((64, 4, 3), (128, 4, 3), (128, 8, 3))
            for sp in (None, 2)]  # fmt: skip
    p.update(triton_paths(c, cfgs))
    return p


def build_study_modules(
    xqa_dtypes: tuple[torch.dtype, ...], prefill: tuple[tuple[torch.dtype, ...], ...],
    cuda_core_fp16: bool = False,
) -> None:  # fmt: skip
    """Build a study's FlashInfer modules for every shape, concurrently, up front: XQA with each
    of ``xqa_dtypes`` as query and output dtype, fa2 prefill (the tensor-core decode's kernel) per
    (q, kv, out) dtype triple in ``prefill``, and the fp16 CUDA-core decode if asked."""
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.xqa import gen_xqa_module

    from torch_kvq.attention.kernels.flashinfer_jit import build

    F16, I32 = torch.float16, torch.int32
    mods = {}
    for qh, kh, d in SHAPES.values():
        specs = [gen_xqa_module(x, FP8, PAGE, d, qh // kh, False, x, 1, False) for x in xqa_dtypes]
        if cuda_core_fp16:
            specs.append(gen_batch_decode_module(F16, FP8, F16, I32, d, d, 0, False, False))
        for q, kv, o in prefill:
            specs.append(
                gen_batch_prefill_module("fa2", q, kv, o, I32, d, d, 0, False, False, False)
            )
        mods.update({js.name: js for js in specs})
    build(mods, max_workers=len(mods))


def build_fp16_modules() -> None:
    """The fp16 study's FlashInfer modules (fp16 query)."""
    F16 = torch.float16
    prefill = ((F16, FP8, F16), (F16, FP8, BF16), (BF16, FP8, BF16), (BF16, BF16, BF16))
    try:
        build_study_modules((F16, BF16), prefill, cuda_core_fp16=True)
    except Exception:  # noqa: BLE001 - the paths that need a module report its failure
        traceback.print_exc(limit=3)


def fp16_study(gbps: float, rounds: int, calls: int, save: Callable) -> list[dict[str, Any]]:
    """Is the accurate paths' ~50-60% of copy bandwidth the FP8 -> bf16 widening? e4m3 -> fp16 is
    one cvt per two values on sm90; e4m3 -> bf16 goes through fp16 (three or four). The same
    kernels with an fp16 query (cast per call, timed) do their math in fp16."""
    build_fp16_modules()
    rows: list[dict[str, Any]] = []
    for name in ("llama", "gemma_global"):
        c = Case(name, 32, 16384)
        rows += measure(c, fp16_paths(c), gbps, rounds, calls, "ref8")
        save(rows)
    return rows


def tma_paths(c: Case, cfgs: list[dict[str, Any]]) -> dict[str, Callable]:
    out = {}
    for kw in cfgs:
        name = "tma[w{num_warps},st{num_stages},ppi{pages_per_iter},s{num_splits}".format(**kw)
        name += ",lazy" * bool(kw.get("lazy_rescale")) + "]"
        TRITON_CFG[name] = kw
        out[name] = lambda kw=kw: tma_path(c, **kw)
    return out


def tma_reference_paths(c: Case) -> dict[str, Callable]:
    F16 = torch.float16
    return {
        "fi_tc_bf16": lambda: fi_wrapper(c, BF16, True),
        "fi_tc_fp8[q fp16, o bf16]": lambda: fi_wrapper(c, FP8, True, q_dtype=F16, o_dtype=BF16),
        "xqa_fp8[pdl=False]": lambda: xqa_direct(c, pdl=False),
        "triton[bn128,w4,st3,s2,qk fp16]": lambda: triton_path(
            c, block_n=128, num_warps=4, num_stages=3, num_splits=2, qk_dtype=F16
        ),
    }


# (warps, stages, pages per iteration, "l" = lazy_rescale). Run 26 of 2026-12-01 swept one page
# per iteration over warps (2, 4) x stages (4, 8, 12); run 27 pages per iteration and one warp (1
# warp, 6 stages, 2 pages best for head 128; 8 stages, 1 page for 256); run 30 the lazy rescale
# and V transposed through shared memory as fp16 (slower on both shapes: 77% / 72%; removed).
TMA_GRID = [
    (1, 6, 2, ""), (1, 6, 2, "l"), (1, 8, 1, ""), (1, 8, 1, "l"), (1, 4, 1, "l"), (1, 6, 1, "l"),
    (1, 4, 2, "l"), (1, 8, 2, "l"),
]  # fmt: skip


def tma_study(gbps: float, rounds: int, calls: int, save: Callable) -> list[dict[str, Any]]:
    """The TMA-per-page Triton kernel (``triton_decode_tma``) against the accurate FlashInfer
    path (tensor cores, fp16 math), XQA (FP8 math, at the bound) and the gathering Triton kernel:
    warps x stages at the default split count, then the split count at the best of those."""
    build_study_modules((BF16,), ((torch.float16, FP8, BF16), (BF16, BF16, BF16)))
    rows: list[dict[str, Any]] = []
    for name in ("llama", "gemma_global"):
        c = Case(name, 32, 16384)
        grid = [
            dict(num_warps=w, num_stages=st, pages_per_iter=ppi, num_splits=None,
                 lazy_rescale="l" in f)
            for w, st, ppi, f in TMA_GRID
        ]  # fmt: skip
        found = measure(
            c, {**tma_reference_paths(c), **tma_paths(c, grid)}, gbps, rounds, calls, "ref8"
        )
        rows += found
        save(rows)
        tma = [r for r in found if r["path"].startswith("tma") and "ms" in r]
        if not tma:
            continue
        best = TRITON_CFG[min(tma, key=lambda r: r["ms"])["path"]]
        cfgs = [{**best, "num_splits": s} for s in (2, 4, 8, 16)]
        rows += measure(c, tma_paths(c, cfgs), gbps, rounds, calls, "ref8")
        save(rows)
    return rows


# (warps, stages, pages per iteration, lazy) per shape around the tuned config (run 34 measured
# the permuted V at these on a variant; run 35 on the package kernel)
VPERM_GRID = {
    "llama": [(1, 6, 2, False), (1, 4, 2, True), (1, 5, 2, True), (1, 7, 2, True), (1, 6, 1, True),
              (1, 6, 4, True)],
    "gemma_global": [(1, 6, 1, True), (1, 4, 1, False), (1, 5, 1, False), (1, 7, 1, False),
                     (1, 8, 1, False), (1, 4, 2, False), (1, 6, 2, True)],
}  # fmt: skip


def vperm_study(gbps: float, rounds: int, calls: int, save: Callable) -> list[dict[str, Any]]:
    """The package kernel (V's columns permuted) at its tuned config and around it, against
    ``tma_variants``' "natural" (V in cache order, the kernel before run 34) at the same tuned
    config, 32 x 16k, Llama and Gemma global shapes. No FlashInfer."""
    import tempfile

    from tma_variants import load_variant

    from torch_kvq.attention.triton import decode_tma as tma

    natural = load_variant("natural", Path(tempfile.mkdtemp()))
    rows: list[dict[str, Any]] = []
    for name, d in (("llama", 128), ("gemma_global", 256)):
        c = Case(name, 32, 16384)
        tuned = tma.tuned(d)
        paths: dict[str, Callable] = {
            "tma[tuned]": lambda c=c, kw=tuned: tma_path(c, **kw),
            "tma_natural[tuned]": lambda c=c, kw=tuned: tma_path(c, kernel=natural, **kw),
        }
        for w, st, ppi, lazy in VPERM_GRID[name]:
            kw = dict(num_warps=w, num_stages=st, pages_per_iter=ppi, lazy_rescale=lazy)
            label = f"tma[w{w},st{st},ppi{ppi}{',lazy' * lazy}]"
            paths[label] = lambda c=c, kw=kw: tma_path(c, **kw)
        rows += measure(c, paths, gbps, rounds, calls, "ref8")
        save(rows)
    return rows


# the largest batches at 16k that fit the H200 with FP8 KV (bench_decode_at_scale, runs 36-37)
CAPACITY_BATCH = {"llama": 110, "gemma_global": 131}


def batch_study(gbps: float, rounds: int, calls: int, save: Callable) -> list[dict[str, Any]]:
    """The TMA kernel at the largest batch (16k) of each shape: its tuned config with the default
    schedule (2 splits at these batches until run 42; since then the balanced schedule at Llama's
    110) and with 1, 3 and 4 splits, and 2 pages per iteration."""
    from torch_kvq.attention.triton import decode_tma as tma

    rows: list[dict[str, Any]] = []
    for name, d in (("llama", 128), ("gemma_global", 256)):
        c = Case(name, CAPACITY_BATCH[name], 16384)
        tuned = {**tma.tuned(d), "num_splits": None}
        cfgs = [tuned] + [{**tuned, "num_splits": s} for s in (1, 3, 4)]
        cfgs.append({**tuned, "pages_per_iter": 2})
        rows += measure(c, tma_paths(c, cfgs), gbps, rounds, calls, "ref8")
        save(rows)
        del c
        torch.cuda.empty_cache()
    return rows


# (programs per SM, max_registers) of the balanced schedule, and the batches, per head size
BALANCED_GRID = {128: ([(12, 128), (16, 128)], (8, 16, 32, 48, 64, 80, 110)),
                 256: ([(8, None)], (8, 64, 131))}  # fmt: skip


def balanced_study(gbps: float, rounds: int, calls: int, save: Callable) -> list[dict[str, Any]]:
    """The TMA kernel's balanced schedule (``programs_per_sm``: every program reads the same
    pages, all resident at once) against its split grid at 16k over batches. Run 41 of
    2026-12-01 (32 and the largest batch): Llama 110 x 16k 93.4% of copy bandwidth at 12 or 16
    programs per SM with 128 registers against 84-92% on the split grid, 88% against 94.6% at
    32 x 16k; Gemma's head 256 97-101% against 100-104% (9 per SM at 224 registers: 70%)."""
    from torch_kvq.attention.triton import decode_tma as tma

    rows: list[dict[str, Any]] = []
    for name, d in (("llama", 128), ("gemma_global", 256)):
        grid, batches = BALANCED_GRID[d]
        for batch in batches:
            c = Case(name, batch, 16384)
            paths = {"tma[tuned]": lambda c=c, d=d: tma_path(c, **tma.tuned(d))}
            for per_sm, regs in grid:
                kw = {**tma.tuned(d), "programs_per_sm": per_sm, "max_registers": regs}
                paths[f"tma[balanced{per_sm},r{regs}]"] = lambda c=c, kw=kw: tma_path(c, **kw)
            rows += measure(c, paths, gbps, rounds, calls, "ref8")
            save(rows)
            del c
            torch.cuda.empty_cache()
    return rows


def tma_bf16_path(c: Case, **kw: Any) -> Callable:
    """The TMA kernel on the bf16 cache (bf16 products: a bf16 cache need not fit fp16)."""
    from torch_kvq.attention.triton import decode_tma as triton_decode_tma

    cache, out = c.bf16_cache(), torch.empty_like(c.q)
    return lambda: triton_decode_tma.paged_decode_tma(
        c.q, cache, c.table, c.seq_lens, 1.0, 1.0, c.sm_scale, max_seq_len=c.ctx, out=out,
        dot_dtype=BF16, **kw,
    )  # fmt: skip


def sliding_study(gbps: float, rounds: int, calls: int, save: Callable) -> list[dict[str, Any]]:
    """Gemma-3's 40 sliding layers stay bf16 and each reads its window (~1024 tokens) per
    sequence: 2.98 ms of a 14.6 ms step at 32 x 16k, 84.5% of copy bandwidth (run 37). The
    FlashInfer tensor-core decode the model runs for them against the TMA kernel on the same
    bf16 cache, at batch 32 and 131, over split counts (one split leaves most SMs idle), and
    FlashInfer's plan without split-KV or with fixed split sizes."""
    from torch_kvq.attention.triton import decode_tma as tma

    rows: list[dict[str, Any]] = []
    for batch in (32, CAPACITY_BATCH["gemma_global"]):
        c = Case("gemma_global", batch, 1024)
        paths: dict[str, Callable] = {"fi_tc_bf16": lambda c=c: fi_wrapper(c, BF16, True)}
        # FlashInfer's own plan options: no split-KV (no merge kernel), fixed splits in pages
        paths["fi_tc_bf16[nosplit]"] = lambda c=c: fi_wrapper(c, BF16, True, disable_split_kv=True)
        for pages in (16, 32):
            paths[f"fi_tc_bf16[split{pages}p]"] = lambda c=c, p=pages: fi_wrapper(
                c, BF16, True, fixed_split_size=p
            )
        for splits in (None, 2, 4, 8, 16):
            kw = {**tma.tuned(256), "num_splits": splits}
            paths[f"tma_bf16[s{splits}]"] = lambda c=c, kw=kw: tma_bf16_path(c, **kw)
        rows += measure(c, paths, gbps, rounds, calls, "ref8")
        save(rows)
    return rows


STUDIES = {  # --<name>-study: a study alone, instead of the whole sweep
    "fp16": (fp16_study, "the fp16-math study"),
    "tma": (tma_study, "the TMA Triton kernel study"),
    "batch": (batch_study, "the TMA kernel at the largest batches, over split counts"),
    "vperm": (vperm_study, "the TMA kernel around its tuned config, and against V in cache "
              "order (tma_variants.py natural)"),
    "sliding": (sliding_study, "Gemma's bf16 sliding layers: FlashInfer against the TMA kernel"),
    "balanced": (balanced_study, "the TMA kernel's balanced schedule against its split grid"),
}  # fmt: skip
