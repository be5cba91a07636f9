"""Time to first token at real model scale (issue 14 item 3): 8 prompts of 16k tokens, all-bf16 KV
against the FP8 config, per FlashInfer prefill option.

Models as in ``bench_decode_at_scale.py`` (torch_kvq's own decoders at Llama-3.1-8B and
Gemma-3-12B dimensions, random bf16 weights, FP8 config skipping layers 0/-1 resp. the sliding
layers). Per model one build; per variant ``configure_kv`` and a ``FlashInferKernel(prefill=...)``:

  bf16 / fa2, bf16 / fa3                       all-bf16 KV
  fp8 / fa2                                    FP8 layers read the FP8 cache on fa2 (bf16 math)
  fp8 / fa3                                    bf16 layers on fa3, FP8 layers on fa2
  fp8 / fa3_fp8                                bf16 layers on fa3, FP8 layers on fa3's FP8 kernel
                                               (query quantized per tensor: FP8 math)
  int8_per_token_head / fa2, fa3 (``--kv``)    per-(token, head) layers: the prompt's pages
  fp8_per_token_head / fa2, fa3                dequantized into a bf16 scratch, then fa2 / fa3
  mixed / fa2                                  the model's per-layer mode map (``MIXED``)
  int4_per_token_head / fa3, int4-recommended / fa3   the 4-bit layers the same way (scratch
  int4_per_token_head-all+channels / fa3       dequantized and un-rotated, then fa3; +channels:
                                               every layer int4 with K channel scales)
  tc4_per_token_head-all / fa3                 every layer tc4 (seeded K bases), its prompt's
                                               pages dequantized by one Triton pass
                                               (``kernels/kv_dequant_tc.py``), then fa3

Each prompt is one forward of ``--len`` tokens (engines cap the tokens per step), logits of the
last token only (``logits_indices``), through ``torch.compile(model, backend=kvq_backend)``
(default; FP8 layers read their cache in place only in a compiled graph: eager runs the readable
unfused form) or eagerly with ``--eager`` (bf16 only). TTFT = the wall time of the
``--prompts`` forwards after one warm-up prompt (JIT builds). Accuracy: the last-token logits of
every variant against bf16 / fa2 on the same weights and prompts (relative Frobenius error).

    python benchmarks/bench_prefill_at_scale.py --models llama-3.1-8b gemma-3-12b
    python benchmarks/bench_prefill_at_scale.py --smoke      # CPU: tiny shapes, reference kernel
    python benchmarks/bench_prefill_at_scale.py --models llama-3.1-8b --kv bf16 int4-recommended --prefills fa3 --page 32
Writes $OUT/prefill_at_scale.json and prefill_at_scale.md.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_at_scale import KV_CONFIGS, MODELS, PAGE, _git_head, build, kv_config  # noqa: E402
from bench_model_decode import profile_steps, sync  # noqa: E402
from gpu_common import environment, write_results  # noqa: E402

from torch_kvq import kvq_backend  # noqa: E402
from torch_kvq.attention.kernels import FlashInferKernel, ReferenceKernel  # noqa: E402

VARIANTS = [("bf16", "fa2"), ("bf16", "fa3"), ("fp8", "fa2"), ("fp8", "fa3"), ("fp8", "fa3_fp8")]
PER_TOKEN_HEAD_VARIANTS = [
    ("int8_per_token_head", "fa2"), ("int8_per_token_head", "fa3"),
    ("fp8_per_token_head", "fa2"), ("fp8_per_token_head", "fa3"), ("mixed", "fa2"),
    ("int4_per_token_head", "fa3"), ("int4-recommended", "fa3"),
    ("int4_per_token_head-all+channels", "fa3"), ("tc4_per_token_head-all", "fa3"),
]  # fmt: skip
PREFILLS = list(dict.fromkeys(p for _, p in VARIANTS))  # the FlashInferKernel prefill options


@torch.no_grad()
def prefill(model, fn, seq: int, ids: torch.Tensor) -> torch.Tensor:
    """One prompt through the model: its KV written, last-token logits; then its pages are freed
    (the next prompt reuses them: the cache holds one prompt)."""
    md = model.allocator.build_batch([(seq, ids.numel())], device=ids.device)
    last = torch.tensor([ids.numel() - 1], device=ids.device)
    try:
        with model.forward_context(md):
            return fn(ids, md.positions, last)
    finally:
        model.allocator.free(seq)


def prebuild_all(model, kvs: dict, variants: list[tuple[str, str]]) -> None:
    """Every variant's FlashInfer prefill modules in one parallel batch (fa3 ones take ~100-200 s
    each on a bare machine; run 22 spent its 230 s building Gemma's one after another)."""
    from torch_kvq.attention.kernels import flashinfer_jit

    mods: dict = {}
    for kv_name, prefill_opt in variants:
        model.configure_kv(kvs[kv_name])
        kernel = FlashInferKernel(prefill=prefill_opt, unfused_attention=False)
        mods.update(flashinfer_jit.jit_specs(kernel, model.kv_specs, phases=("prefill",)))
    todo = sum(not js.is_compiled for js in mods.values())
    t0 = time.perf_counter()
    flashinfer_jit.build(mods, max_workers=len(mods))
    print(f"prefill modules: {len(mods)}, {todo} built in {time.perf_counter() - t0:.0f} s")


def run_model(name: str, args, env, save) -> list[dict]:
    device = "cpu" if args.smoke else "cuda"
    kvs = {
        kv: kv_config(kv, name, args.page, args.smoke) for kv in dict.fromkeys(["bf16", *args.kv])
    }
    pages = -(-args.len // args.page) + 1
    torch.manual_seed(0)
    model = build(name, kvs["bf16"], ReferenceKernel(), device, args.smoke, pages, None)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (args.len,), generator=gen).to(device)
               for _ in range(args.prompts + 1)]  # fmt: skip
    rows, ref = [], None
    variants = [v for v in VARIANTS + PER_TOKEN_HEAD_VARIANTS if v[0] in args.kv
                and (not args.eager or v[0] == "bf16") and v[1] in args.prefills]  # fmt: skip
    if not args.smoke:
        prebuild_all(model, kvs, variants)
    fn = model
    for kv_name, prefill_opt in variants:
        row = {"model": name, "kv_config": kv_name, "prefill": prefill_opt, "prompts": args.prompts,
               "len": args.len, "page": args.page, "date": env["date_utc"], "gpu": env.get("gpu", "cpu"),
               "commit": args.commit, "mode": "eager" if args.eager else "kvq_backend"}  # fmt: skip
        try:
            model.kernel = (ReferenceKernel() if args.smoke
                            else FlashInferKernel(prefill=prefill_opt, unfused_attention=False))  # fmt: skip
            model.configure_kv(kvs[kv_name])  # fresh caches and allocator
            if not args.eager:  # one graph per kv config; the kernel is read at run time
                torch._dynamo.reset()
                fn = torch.compile(model, backend=kvq_backend, dynamic=False)
            t0 = time.perf_counter()
            prefill(model, fn, 10_000, prompts[-1])  # warm-up: compile, JIT, cuBLAS, allocator
            sync(device)
            row["warmup_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            logits = [prefill(model, fn, i, p) for i, p in enumerate(prompts[:-1])]
            sync(device)
            row["ttft_s"] = time.perf_counter() - t0
            row["tokens_per_s"] = args.prompts * args.len / row["ttft_s"]
            if args.profile:  # one more prompt under torch.profiler: GPU time by kernel
                step = functools.partial(prefill, model, fn, 20_000, prompts[0])
                prof = profile_steps(step, device, 1)
                row["gpu_ms_by_kind"] = prof["gpu_ms_by_kind"]
                row["kernels"] = prof["kernels_per_step"][:12]
            out = torch.cat(logits).float()
            if ref is None:
                ref = out
            row["logits_rel_err_vs_bf16_fa2"] = float((out - ref).norm() / ref.norm())
        except Exception as e:  # noqa: BLE001 - recorded; the other variants still run
            row["error"] = repr(e)[:400]
        print(row, flush=True)
        rows.append(row)
        save(rows)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    base = {r["kv_config"] + "/" + r["prefill"]: r.get("ttft_s") for r in rows}
    for r in rows:
        for b in ("fa2", "fa3"):
            if r.get("ttft_s") and base.get(f"bf16/{b}"):
                r[f"x_vs_bf16_{b}"] = base[f"bf16/{b}"] / r["ttft_s"]
    save(rows)
    del model
    gc.collect()
    return rows


def _x(row: dict, base: str) -> str:
    return f"{row[f'x_vs_bf16_{base}']:.2f}" if f"x_vs_bf16_{base}" in row else ""


def markdown(rows: list[dict], env: dict) -> str:
    lines = [f"## Prefill at scale ({env.get('gpu', 'cpu')}, {env['date_utc']})", "",
             "| model | kv | prefill | prompts x len | TTFT s | tokens/s | x bf16 fa2 | x bf16 fa3 | "
             "logits rel err |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['kv_config']} | {r['prefill']} | error: "
                         f"{r['error'][:120]} | | | | | |")  # fmt: skip
            continue
        lines.append(
            f"| {r['model']} | {r['kv_config']} | {r['prefill']} | {r['prompts']} x {r['len']} | "
            f"{r['ttft_s']:.3f} | {r['tokens_per_s']:.0f} | {_x(r, 'fa2')} | {_x(r, 'fa3')} | "
            f"{r['logits_rel_err_vs_bf16_fa2']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--page", type=int, default=PAGE, help="tokens per cache page, every config")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, reference kernel")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (bf16 variants only)")
    ap.add_argument("--profile", action="store_true",
                    help="one more prompt per variant under torch.profiler: GPU ms by kernel kind "
                         "and the top kernels (where a mode's write and scratch pass go)")  # fmt: skip
    ap.add_argument("--prefills", nargs="+", default=PREFILLS, choices=PREFILLS)
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8"], choices=KV_CONFIGS,
                    help="KV configs (bench_decode_at_scale.KV_CONFIGS); bf16 / fa2 is the "
                    "reference of the accuracy column")  # fmt: skip
    ap.add_argument("--commit", default=os.environ.get("KVQ_COMMIT") or _git_head())
    args = ap.parse_args()
    if args.smoke:
        args.prompts, args.len = 2, 48
    env = environment()
    rows: list[dict] = []

    def save(model_rows: list[dict]) -> None:  # after every variant: a cut-short run keeps rows
        done = rows + model_rows
        write_results("prefill_at_scale", {"env": env, "rows": done}, markdown(done, env))

    for name in args.models:
        rows += run_model(name, args, env, save)


if __name__ == "__main__":
    main()
