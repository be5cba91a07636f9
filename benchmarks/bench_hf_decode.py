"""Decode at Llama-3.1-8B shape through the Hugging Face integration, side by side in one run:
``KVQCausalLM`` (FP8 KV with skip (0, -1), via XQA and via the tensor-core wrapper; all-bf16),
torch_kvq's own Llama decoder on the same weights (the integration's overhead), and what an HF
user would pick instead: HF's ``StaticCache`` + ``torch.compile(mode="reduce-overhead")``, sdpa,
bf16.

Every kvq variant is ``torch.compile(lm, backend=kvq_backend)`` + ``DecodeGraphRunner`` (one CUDA
graph for the batch), timed with ``bench_model_decode.run`` (caches filled with random values and
pages reserved: a decode step costs the same whatever the cache holds). The HF variant fills its
static cache with random values the same way, then times ``model(ids [B, 1], cache_position)``
steps; its cache is sized to the context (``max_cache_len = ctx + steps``), so each context is a
new compile. Weights: random bf16 at the real dimensions (``LLAMA_8B``), built on the GPU.

    python benchmarks/bench_hf_decode.py --batch 32 --ctx 4096 16384
    python benchmarks/bench_hf_decode.py --tiny --device cpu --kernel reference --ctx 64 --steps 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # see bench_model_decode.py

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model_decode import GRAPHS, fill_caches, profile_steps, run, spin_gpu, sync  # noqa: E402
from gpu_common import copy_bandwidth, environment, write_results  # noqa: E402

import torch_kvq  # noqa: E402
from torch_kvq.attention.graph_runner import DecodeGraphRunner  # noqa: E402
from torch_kvq.attention.kernels import FlashInferKernel, ReferenceKernel  # noqa: E402
from torch_kvq.progress import Progress  # noqa: E402
from torch_kvq.spec import KVCacheConfig  # noqa: E402

LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
TINY = dict(LLAMA_8B, vocab_size=512, hidden_size=128, intermediate_size=256,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip
FP8 = KVCacheConfig("fp8", skip_layers=(0, -1), page_size=16)
BF16 = KVCacheConfig("auto", page_size=16)
HF_STATIC = "HF StaticCache + torch.compile reduce-overhead (sdpa, bf16)"


def hf_model(shape: dict, device: str, attn: str = "sdpa") -> torch.nn.Module:
    """A transformers LlamaForCausalLM with random bf16 weights, built on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape)
    cfg._attn_implementation = attn
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def kernels(args):
    if args.kernel == "reference":
        return lambda **kw: ReferenceKernel()
    return lambda **kw: FlashInferKernel(phases="decode", unfused_attention=False, **kw)


def kvq_variants(args) -> list[tuple[str, str, KVCacheConfig, dict]]:
    """(label, model kind, kv config, kernel options)."""
    return [
        (f"HF KVQCausalLM (fp8, XQA){GRAPHS}", "hf", FP8, {"fp8_decode": "xqa"}),
        (f"HF KVQCausalLM (fp8, tensor cores){GRAPHS}", "hf", FP8, {}),
        (f"HF KVQCausalLM all-bf16{GRAPHS}", "hf", BF16, {}),
        (f"own LlamaModel (fp8, XQA){GRAPHS}", "own", FP8, {"fp8_decode": "xqa"}),
        (f"own LlamaModel all-bf16{GRAPHS}", "own", BF16, {}),
    ]


def build_kvq(kind: str, hf, shape: dict, kv, kernel, pages: int, device: str):
    from torch_kvq.integrations.transformers import KVQCausalLM
    from torch_kvq.models.llama import LlamaModel
    from torch_kvq.models.presets import tiny_llama_config

    if kind == "hf":
        model = KVQCausalLM.from_hf(hf, kv, num_pages=pages, kernel=kernel)
    else:
        model = LlamaModel(tiny_llama_config(**shape), kv, pages, dtype=torch.bfloat16,
                           device=device, kernel=kernel).eval()  # fmt: skip
        model.load_hf_state_dict(hf.state_dict())
    if isinstance(kernel, FlashInferKernel):
        from torch_kvq.attention.kernels import flashinfer_jit

        flashinfer_jit.prebuild(kernel, model.kv_specs)
    return model


@torch.no_grad()
def run_hf_static(hf, batch: int, ctx: int, steps: int, warmup: int, device: str, profile: int):
    """HF's own path: StaticCache filled to ``ctx`` with random values, compiled decode steps."""
    from transformers import StaticCache

    cfg = hf.config
    cache = StaticCache(config=cfg, max_cache_len=ctx + warmup + steps + profile + 8)
    dummy = torch.zeros(batch, 1, dtype=torch.long, device=device)
    hf(
        input_ids=dummy,
        past_key_values=cache,
        use_cache=True,
        cache_position=torch.tensor([0], device=device),
    )  # fmt: skip  (lazily allocates the layers)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            t.copy_(torch.randn_like(t))
    step_fn = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    pos = [ctx]

    def step() -> torch.Tensor:
        ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=device)
        p = torch.tensor([pos[0]], device=device)
        pos[0] += 1
        out = step_fn(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=p,
                      position_ids=p.expand(batch, 1))  # fmt: skip
        return out.logits

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync(device)
    first = time.perf_counter() - t0
    spin_gpu(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    step_s = (time.perf_counter() - t0) / steps
    try:
        prof = profile_steps(step, device, profile) if profile else {}
    except Exception as e:  # noqa: BLE001 - the timing stands; say why there is no profile
        prof = {"profile_error": repr(e)[:300]}
    return {"variant": HF_STATIC, "batch": batch, "ctx": ctx, "step_ms": step_s * 1e3,
            "tokens_per_s": batch / step_s, "warmup_s_incl_compile": first, **prof}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--kernel", choices=["flashinfer", "reference"], default="flashinfer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama (smoke run)")
    ap.add_argument("--only", nargs="*", default=None, help="variants whose label has one of these")
    args = ap.parse_args()
    shape = TINY if args.tiny else LLAMA_8B
    env = environment()
    copy = copy_bandwidth() if args.device == "cuda" else None
    hf = hf_model(shape, args.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    extra = args.warmup + args.steps + args.profile_steps + 8
    pages = args.batch * (-(-(max(args.ctx) + extra) // 16)) + 16
    make_kernel, rows = kernels(args), []
    todo = [v for v in kvq_variants(args) if not args.only or any(o in v[0] for o in args.only)]
    bar = Progress("bench_hf_decode", len(todo), unit="variants")
    for label, kind, kv, kopts in todo:
        bar.update(status=label)
        model = fn = None
        try:
            model = build_kvq(kind, hf, shape, kv, make_kernel(**kopts), pages, args.device)
            fill_caches(model)
            fn = DecodeGraphRunner(model, torch.compile(model, backend=torch_kvq.kvq_backend),
                                   batch_sizes=(args.batch,), max_context=max(args.ctx) + extra,
                                   capture=args.device == "cuda")  # fmt: skip
            for ctx in args.ctx:
                rows.append(run(label, model, fn, args.batch, ctx, args.steps, args.warmup,
                                args.device, args.profile_steps))  # fmt: skip
                bar.echo(rows[-1])
        except Exception as e:  # noqa: BLE001 - recorded, the other variants still run
            rows.append({"variant": label, "batch": args.batch, "ctx": 0, "error": repr(e)[:400]})
            bar.echo(rows[-1])
        finally:
            bar.update(bar.done + 1)
            if kind == "hf" and model is not None:
                model.detach()
            model = fn = None
            torch._dynamo.reset()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    bar.close()
    if not args.only or any(o in HF_STATIC for o in args.only):
        for ctx in args.ctx:
            try:
                rows.append(run_hf_static(hf, args.batch, ctx, args.steps, args.warmup,
                                          args.device, args.profile_steps))  # fmt: skip
            except Exception as e:  # noqa: BLE001
                rows.append({"variant": HF_STATIC, "batch": args.batch, "ctx": ctx,
                             "error": repr(e)[:400]})  # fmt: skip
            print(rows[-1], flush=True)
            torch._dynamo.reset()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    write_results("bench_hf_decode", {"env": env, "args": vars(args), "copy_bandwidth": copy,
                                      "weight_bytes": weight_bytes, "rows": rows},
                  table(rows, env, args, weight_bytes, copy))  # fmt: skip


def table(rows: list[dict], env: dict, args, weight_bytes: int, copy: dict | None) -> str:
    lines = ["## HF integration: decode at Llama-3.1-8B shape", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- batch {args.batch}, {args.steps} steps after {args.warmup} warm-up; weights "
              f"{weight_bytes / 1e9:.2f} GB", ""]  # fmt: skip
    lines += ["| batch x ctx | variant | step ms | tokens/s | x vs HF StaticCache | GPU kernel ms |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    hf_rows = {r["ctx"]: r for r in rows if r["variant"] == HF_STATIC and "step_ms" in r}
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['batch']} x {r['ctx']} | {r['variant']} | failed: {r['error']} | | | |"
            )
            continue
        base = hf_rows.get(r["ctx"])
        x = f"{base['step_ms'] / r['step_ms']:.1f}" if base else "-"
        k = f"{r['gpu_kernel_ms_per_step']:.2f}" if "gpu_kernel_ms_per_step" in r else "-"
        lines.append(f"| {r['batch']} x {r['ctx']} | {r['variant']} | {r['step_ms']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {x} | {k} |")  # fmt: skip
    for r in rows:
        if "gpu_ms_by_kind" in r:
            lines.append(f"- {r['variant']} @ {r['ctx']} gpu_ms_by_kind: {r['gpu_ms_by_kind']}")
        if r.get("variant") == HF_STATIC and "kernels_per_step" in r:  # where (c)'s time goes
            top = [(k[0][:70], k[1], k[2]) for k in r["kernels_per_step"][:8]]
            lines.append(f"- {HF_STATIC} @ {r['ctx']} top kernels (name, ms, calls): {top}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
