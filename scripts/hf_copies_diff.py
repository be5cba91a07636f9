"""Where two copies of one HF model first part ways: the failing GPU test
``test_hf_gpu.py::test_gemma3_shaped_per_token_head_map_replays_in_cuda_graphs`` (two copies of a
Gemma-3-shaped model, int8 per (token, head) on sliding layer 0, a 4-bit mode on the global layer
5, compiled with the kvq passes) sees different prefill logits whenever other GPU work runs
beside it (docs/design/int4-branch.md, thirteenth session). This prefills both copies and prints,
per attention layer, whether their caches (codes and scales) are equal bit for bit, then the
logits: the first layer that differs is where to look. ``--load`` runs a second process of
matmuls and allocations on the same GPU throughout (the failing runs' condition);
``--eager`` skips torch.compile; ``--repeat N`` prefills N pairs; ``--dirty`` fills this process's
cached GPU memory with 0x7F bytes before each copy (a read of memory nothing wrote then sees
large values, not the zeros a fresh allocation often holds); ``--nan-empty`` has torch fill every
``torch.empty`` with NaN (``torch.utils.deterministic.fill_uninitialized_memory``); ``--runner``
decodes as the test does (an uncapturing, then a capturing ``DecodeGraphRunner``).

    python3 scripts/hf_copies_diff.py int4_per_token_head --load          # the GPU (FlashInfer)
    python3 scripts/hf_copies_diff.py k8v4_per_token_head --device cpu    # reference kernel
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT_LENS = (1100, 300, 40)  # the test's: they cross the 1024-token window


def gemma3_shaped(device: str) -> torch.nn.Module:
    """The test's model (tests/integrations/test_hf_gpu.py), on ``device``."""
    import transformers

    from torch_kvq.models import randomize_weights_

    cfg = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=1024, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    model = transformers.Gemma3ForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()
    randomize_weights_(model, 0, norm_offset=True)
    return model


def _load(stop: mp.Event) -> None:  # type: ignore[valid-type]
    """Other GPU work: matmuls and fresh allocations until ``stop``."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        junk = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0xFF)]
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        del junk
        torch.cuda.synchronize()


def _dirty() -> None:
    """Leave 0x7F garbage in the caching allocator's free blocks, small pool and large."""
    junk = [torch.full((256 << 10,), 0x7F, dtype=torch.uint8, device="cuda") for _ in range(2048)]
    junk.append(torch.full((4 << 30,), 0x7F, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    del junk


def history(device: str) -> None:
    """What test_hf_gpu.py's first test compiles before the failing one (an FP8 map on the
    same model class, generated eager then compiled) in the same process."""
    from torch_kvq import KVCacheConfig
    from torch_kvq.integrations.transformers import KVQCausalLM
    from torch_kvq.models import generate
    from torch_kvq.passes import make_kvq_backend

    kw = {}
    if device == "cuda":
        from torch_kvq.attention.kernels import FlashInferKernel

        kw["kernel"] = FlashInferKernel()
    kv = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=16)
    lm = KVQCausalLM.from_hf(gemma3_shaped(device), kv, num_pages=160, **kw)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    eager = generate(lm, prompts, 6)
    compiled = torch.compile(lm, backend=make_kvq_backend(), fullgraph=True)
    generate(lm, prompts, 6, compiled, force_tokens=eager.tokens)


def prefill_pair(
    mode: str, device: str, eager: bool, dirty: bool = False, runner: bool = False
) -> dict[str, object]:
    """Two copies prefilled on the same prompts: per layer, caches equal; logits equal. With
    ``runner``, as the test: six tokens each, decoded through an uncapturing then a capturing
    ``DecodeGraphRunner`` (batch 4)."""
    from torch_kvq import KVCacheConfig
    from torch_kvq.integrations.transformers import KVQCausalLM
    from torch_kvq.models import generate
    from torch_kvq.passes import make_kvq_backend

    kv = KVCacheConfig(
        "auto", layer_modes=(("full_attention", mode), (0, "int8_per_token_head")), page_size=16
    )
    hf = gemma3_shaped(device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    backend = make_kvq_backend()
    lms, runs = [], []
    for i in range(2):
        if dirty:
            _dirty()
        kw = {}
        if device == "cuda":
            from torch_kvq.attention.kernels import FlashInferKernel
            from torch_kvq.attention.kernels.flashinfer_jit import prebuild

            kw["kernel"] = FlashInferKernel()
        lm = KVQCausalLM.from_hf(copy.deepcopy(hf), kv, num_pages=160, prefix=f"copy{i}", **kw)
        if "kernel" in kw:
            prebuild(kw["kernel"], lm.kv_specs)
        fwd = lm if eager else torch.compile(lm, backend=backend, fullgraph=True)
        if runner:
            from torch_kvq.attention.graph_runner import DecodeGraphRunner

            with DecodeGraphRunner(lm, fwd, batch_sizes=(4,), max_context=1200,
                                   capture=bool(i) and device == "cuda") as r:  # fmt: skip
                runs.append(generate(lm, prompts, 6, fwd, decode=r, prefill_logits=True))
        else:
            # one new token: the prefill only; the pages stay (generate frees them at the end,
            # the cache bytes remain)
            runs.append(generate(lm, prompts, 1, fwd, prefill_logits=True))
        lms.append(lm)
    layers = {}
    for a, b in zip(*(lm.attention_layers for lm in lms)):
        same = torch.equal(a.kv_cache.view(torch.uint8), b.kv_cache.view(torch.uint8))
        if a.kv_scale is not None:
            same = same and torch.equal(a.kv_scale, b.kv_scale)
        layers[a.spec.name] = {"mode": a.spec.mode.value, "cache_equal": same}
    pre = [torch.equal(x, y) for x, y in zip(runs[0].prefill_logits, runs[1].prefill_logits)]
    diff = max((x - y).abs().max().item() for x, y in zip(*(r.prefill_logits for r in runs)))
    out = {"layers": layers, "prefill_logits_equal": pre, "max_abs_diff": diff}
    if runner:
        out["tokens_equal"] = runs[0].tokens == runs[1].tokens
        out["logits_equal"] = torch.equal(runs[0].logits, runs[1].logits)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["int4_per_token_head", "k8v4_per_token_head"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--load", action="store_true", help="a second process on the GPU throughout")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--dirty", action="store_true", help="0x7F garbage in freed GPU memory")
    ap.add_argument("--runner", action="store_true", help="decode 6 tokens as the test does")
    ap.add_argument("--history", action="store_true", help="first what the file's first test runs")
    ap.add_argument("--nan-empty", action="store_true", help="torch.empty filled with NaN")
    args = ap.parse_args()
    if args.nan_empty:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    stop, proc = None, None
    if args.load:
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        proc = ctx.Process(target=_load, args=(stop,), daemon=True)
        proc.start()
    try:
        if args.history:
            history(args.device)
        for i in range(args.repeat):
            res = prefill_pair(args.mode, args.device, args.eager, args.dirty, args.runner)
            print(json.dumps({"pair": i, **res}))
            sys.stdout.flush()
    finally:
        if proc is not None and stop is not None:
            stop.set()
            proc.join(timeout=30)


if __name__ == "__main__":
    main()
