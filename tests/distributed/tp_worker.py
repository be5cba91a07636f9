"""One rank of the 2-process tensor-parallel checks (launched by ``launch.torchrun``, gloo).

``python tp_worker.py SCENARIO OUT_DIR``: runs the scenario's cases on this rank and writes
``OUT_DIR/rank<r>.json`` (numbers and messages the tests in ``test_tp.py`` assert on). Not a test
module. Every model is built twice on each rank, once whole (the single-process reference) and
once as this rank's shard, from the same seed.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from tests.distributed.code_flips import QuantTrace, code_flips, slot_view
from torch_kvq.attention import quant_tc
from torch_kvq.distributed import RankRefusedError, init_tensor_parallel
from torch_kvq.models import build_model, generate
from torch_kvq.spec import KVCacheConfig

PROMPTS = [[5, 9, 14, 3, 7, 2, 11, 30, 4, 6, 8, 12], [8, 2, 4], [19, 3, 3, 27, 40, 41]]
NEW = 2  # the prefill, then one decode step (two compiled graphs)
SCALES = dict(default_k_scale=0.05, default_v_scale=0.05)
# (preset, skip rule): a Llama shape with its first and last layers kept, a Gemma 3 shape with
# its sliding-window layers kept
OWN = (("llama-tiny", (0, -1)), ("gemma3-tiny", ("sliding_window",)))
HF = (("llama", (0, -1)), ("gemma3", ("sliding_window",)))


def max_diff(a, b) -> float:
    pre = max((x - y).abs().max().item() for x, y in zip(a.prefill_logits, b.prefill_logits))
    return max(pre, (a.logits - b.logits).abs().max().item())


def scale(res) -> float:
    return max(res.logits.abs().max().item(), *(p.abs().max().item() for p in res.prefill_logits))


def report_fused() -> dict[str, list[str]]:
    from torch_kvq.passes import last_report

    rep = last_report()
    kinds = ("quant+write", "dequant+attn", "output quant")
    return {k: sorted(rep.layers_fused(k)) for k in kinds} | {"layers": sorted(rep.layers)}


def compiled(model, backend):
    if hasattr(model, "compiled_forward"):
        return model.compiled_forward(backend)
    return torch.compile(model, backend=backend, fullgraph=True)


def parity(tp) -> dict:
    from torch_kvq.integrations.hf_tiny import tiny_hf_model
    from torch_kvq.integrations.transformers import KVQCausalLM
    from torch_kvq.passes import kvq_backend, make_kvq_backend

    out: dict = {}
    cases = [("own", *c) for c in OWN] + [("hf", *c) for c in HF]
    for kind, name, skip in cases:
        t0 = time.perf_counter()
        kv = KVCacheConfig("fp8", skip_layers=skip, page_size=4, **SCALES)
        if kind == "own":
            own = dict(num_pages=32, dtype=torch.float32)
            single = build_model(name, kv, prefix=f"single_{name}", **own)
            shard = build_model(name, kv, prefix=f"tp_{name}", tp=tp, **own)
        else:
            hf = tiny_hf_model(name)
            single = KVQCausalLM.from_hf(
                copy.deepcopy(hf), kv, num_pages=32, prefix=f"single_{name}"
            )
            shard = KVQCausalLM.from_hf(hf, kv, num_pages=32, prefix=f"tp_{name}", tp=tp)
        ref = generate(single, PROMPTS, NEW, prefill_logits=True)
        eager = generate(shard, PROMPTS, NEW, force_tokens=ref.tokens, prefill_logits=True)
        row = {
            "max_diff": max_diff(ref, eager),
            "scale": scale(ref),
            "same_tokens": eager.logits.argmax(-1).tolist() == ref.tokens,
            "local_heads": sorted({(s.num_heads, s.num_kv_heads) for s in shard.kv_specs}),
            "global_heads": sorted({(s.num_heads, s.num_kv_heads) for s in single.kv_specs}),
            "quantized": sorted(s.name for s in shard.kv_specs if s.is_quantized),
            "kept": sorted(s.name for s in shard.kv_specs if not s.is_quantized),
            "cache_shape": list(shard.attention_layers[0].kv_cache.shape),
        }
        # compiled with the kvq passes: Inductor on our Llama shape, elsewhere the passes with the
        # eager inner compiler (the same post-grad graph; a cold Inductor compile costs ~20 s here)
        inner = "inductor" if name == "llama-tiny" else "eager"
        backend = kvq_backend if inner == "inductor" else make_kvq_backend(inner="eager")
        torch._dynamo.reset()
        comp = generate(
            shard,
            PROMPTS,
            NEW,
            forward=compiled(shard, backend),
            force_tokens=ref.tokens,
            prefill_logits=True,
        )
        row |= {"inner": inner, "compiled_diff": max_diff(eager, comp), "report": report_fused()}
        if kind == "own":  # q/k/v and gate/up as one GEMM each, on the shard
            shard.fuse_projections()
            fused = generate(shard, PROMPTS, NEW, force_tokens=ref.tokens, prefill_logits=True)
            row["fused_diff"] = max_diff(ref, fused)
        row["seconds"] = time.perf_counter() - t0
        out[f"{kind}:{name}"] = row
        torch._dynamo.reset()
    return out


# per-layer mode maps (label -> preset, default mode, layer_modes): issue 32's three modes at once;
# issue 33's 4-bit modes, each alone and mixed with int8 and unquantized (fp32 here) layers
MAPS_8BIT = {
    "llama-tiny": ("llama-tiny", "auto",
                   ((0, "fp8"), (1, "int8_per_token_head"), (-1, "fp8_per_token_head"))),
    "gemma3-tiny": ("gemma3-tiny", "auto", (("full_attention", "int8_per_token_head"), (0, "fp8"))),
}  # fmt: skip
INT4, K8V4, INT8 = "int4_per_token_head", "k8v4_per_token_head", "int8_per_token_head"
MAPS_4BIT = {
    "llama-tiny:int4": ("llama-tiny", INT4, ()),
    "llama-tiny:k8v4": ("llama-tiny", K8V4, ()),
    "llama-tiny:mixed": ("llama-tiny", "auto", ((0, INT4), (1, K8V4), (2, INT8))),
    "gemma3-tiny:mixed": ("gemma3-tiny", INT4, (("full_attention", K8V4), (0, INT8), (1, "auto"))),
    "llama-tiny:int4-channels": ("llama-tiny", INT4, ()),
}
# the layers given K channel scales (2 kv heads of 32, seeded: every rank builds the same)
CHANNELS = {"llama-tiny:int4-channels": (0, 2)}


def k_channels(label: str) -> dict:
    from torch_kvq.spec_channels import KChannelScale

    out = {}
    for i in CHANNELS.get(label, ()):
        g = torch.Generator().manual_seed(100 + i)
        out[i] = KChannelScale(
            torch.rand(2, 32, generator=g) * 3 + 0.3, torch.randn(2, 32, generator=g)
        )
    return out


def modes(tp, maps: dict) -> dict:
    """Per-layer mode maps under TP (issues 32, 33): ``maps`` (``MAPS_8BIT`` / ``MAPS_4BIT``),
    each rank's per-(token, head) scales covering its own kv heads.

    Besides the logits, the layer-by-layer comparison ``test_tp.check_modes`` asserts on:
    ``rows`` (per attention call of the eager runs, in execution order: the largest difference of
    the inputs q / k / v and of the output between the whole model, on this rank's heads, and the
    shard; the per-(token, head) scales' relative difference, int4's zero points' differences),
    ``flips`` (every cache code that differs, whole model vs shard and eager shard vs compiled
    shard, with its pre-quantization values) and ``values`` (how many k / v values the quantized
    layers wrote on this rank).
    """
    from torch_kvq.passes import make_kvq_backend

    out: dict = {}
    for label, (name, default, layer_modes) in maps.items():
        scales = {0: (0.05, 0.05)} if maps is MAPS_8BIT else {}  # layer 0's fp8 per tensor
        kv = KVCacheConfig(default, layer_modes=layer_modes, page_size=4, kv_scales=scales,
                           k_channel_scales=k_channels(label))  # fmt: skip
        own = dict(num_pages=32, dtype=torch.float32)
        tag = label.replace(":", "_")  # layer names are unique per process
        single = build_model(name, kv, prefix=f"msingle_{tag}", **own)
        shard = build_model(name, kv, prefix=f"mtp_{tag}", tp=tp, **own)
        # the compiled run on a fresh shard: its cache slots are the eager shard's, code for code
        comp_shard = build_model(name, kv, prefix=f"mtpc_{tag}", tp=tp, **own)
        t_single, t_shard = QuantTrace(single), QuantTrace(shard)
        ref = generate(single, PROMPTS, NEW, prefill_logits=True)
        eager = generate(shard, PROMPTS, NEW, force_tokens=ref.tokens, prefill_logits=True)
        torch._dynamo.reset()
        comp = generate(
            comp_shard, PROMPTS, NEW, forward=compiled(comp_shard, make_kvq_backend(inner="eager")),
            force_tokens=ref.tokens, prefill_logits=True,
        )  # fmt: skip
        kh, qh = shard.kv_specs[0].num_kv_heads, shard.kv_specs[0].num_heads
        kvs, qs = slice(tp.rank * kh, (tp.rank + 1) * kh), slice(tp.rank * qh, (tp.rank + 1) * qh)
        rows = []
        for a, b in zip(t_single.calls, t_shard.calls, strict=True):
            assert a["layer"] == b["layer"] and torch.equal(a["slots"], b["slots"])
            diffs = [(a[n][:, hs] - b[n]).abs().max().item() for n, hs in
                     (("q", qs), ("k", kvs), ("v", kvs), ("out", qs))]  # fmt: skip
            rows.append({"layer": a["layer"], "in_diff": max(diffs[:3]), "out_diff": diffs[3]})
        flips, values = [], 0
        for i, spec in enumerate(shard.kv_specs):
            if not spec.is_quantized:
                continue
            s_view = slot_view(single.attention_layers[i], kvs)
            e_view = slot_view(shard.attention_layers[i])
            c_view = slot_view(comp_shard.attention_layers[i])
            ys, ye, row = t_single.y[i][:, :, kvs], t_shard.y[i], t_shard.row[i]
            values += int((row >= 0).sum()) * 2 * kh * spec.head_size
            if e_view[1] is not None:  # per-(token, head) scales, each row's written slots
                rel = ((s_view[1] - e_view[1]).abs() / e_view[1].clamp(min=1e-30)).amax((1, 2))
                zp = (s_view[2] != e_view[2]).sum((1, 2))  # int4's zero points (0 elsewhere)
                for r in row.unique().tolist():
                    if r >= 0:
                        rows[r]["scale_rel"] = rel[row == r].max().item()
                        rows[r]["zp_diffs"] = int(zp[row == r].sum())
            flips += [
                f | {"pair": "single/shard"} for f in code_flips(spec, s_view, e_view, ys, ye, row)
            ]
            flips += [
                f | {"pair": "shard/compiled"}
                for f in code_flips(spec, e_view, c_view, ye, None, row)
            ]
        out[label] = {
            "max_diff": max_diff(ref, eager),
            "compiled_diff": max_diff(eager, comp),
            "rows": rows,
            "flips": flips,
            "values": values,
            "modes": [s.mode.value for s in shard.kv_specs],
            "global_kv_heads": single.kv_specs[0].num_kv_heads,
            "scale_shapes": [
                None if a.kv_scale is None else list(a.kv_scale.shape)
                for a in shard.attention_layers
            ],
            "cache_shapes": [list(a.kv_cache.shape) for a in shard.attention_layers],
            "k_channel_shapes": [
                None if a.k_channel_scale is None else list(a.k_channel_scale.shape)
                for a in shard.attention_layers
            ],
            "cache_dtypes": [str(a.kv_cache.dtype) for a in shard.attention_layers],
            "scales_written": all(
                a.kv_scale is None or bool(a.kv_scale.any()) for a in shard.attention_layers
            ),
            "report": report_fused(),
        }
        torch._dynamo.reset()
    return out


def tc4(tp) -> dict:
    """``tc4_per_token_head`` under TP (issue 33): a Llama shape with tc4 on layers 0 and 2 (seeded
    K bases, 2 kv heads of 32; every rank builds the same), int4 on 1, layer 3 kept. Each rank's
    caches hold its kv head's code and side rows, its layers its kv head's basis; the rows it wrote
    equal the whole model's on that head (bytes that differ are counted: a rounding-boundary flip
    of a value the two runs computed apart in the last bits), the logits within ``TOL``, compiled
    equal to eager."""
    from torch_kvq.passes import make_kvq_backend
    from torch_kvq.spec_channels import KBasis

    bases = {}
    for i in (0, 2):
        g = torch.Generator().manual_seed(200 + i)
        bases[i] = KBasis.of(torch.eye(32) + torch.randn(2, 32, 32, generator=g) / 32**0.5)
    modes = ((0, "tc4_per_token_head"), (1, "int4_per_token_head"), (2, "tc4_per_token_head"))
    kv = KVCacheConfig("auto", layer_modes=modes, page_size=4, k_bases=bases)
    own = dict(num_pages=32, dtype=torch.float32)
    single = build_model("llama-tiny", kv, prefix="tsingle", **own)
    shard = build_model("llama-tiny", kv, prefix="ttp", tp=tp, **own)
    comp_shard = build_model("llama-tiny", kv, prefix="ttpc", tp=tp, **own)
    ref = generate(single, PROMPTS, NEW, prefill_logits=True)
    eager = generate(shard, PROMPTS, NEW, force_tokens=ref.tokens, prefill_logits=True)
    torch._dynamo.reset()
    comp = generate(
        comp_shard, PROMPTS, NEW, forward=compiled(comp_shard, make_kvq_backend(inner="eager")),
        force_tokens=ref.tokens, prefill_logits=True,
    )  # fmt: skip
    torch._dynamo.reset()
    kh = shard.kv_specs[0].num_kv_heads
    mine = slice(tp.rank * kh, (tp.rank + 1) * kh)
    layers = []
    for i in (0, 2):
        whole, part, comp_part = (m.attention_layers[i] for m in (single, shard, comp_shard))
        written = part.kv_cache[:, 0].any(-1).any(-1)  # [pages, page]: the slots this run wrote
        # [slots, 2, kv heads, D / 2] code rows and [slots, kv heads, record bytes] aux records
        codes_w = whole.kv_cache[:, :, :, mine].permute(0, 2, 1, 3, 4)[written]
        codes_s = part.kv_cache.permute(0, 2, 1, 3, 4)[written]
        side_w = quant_tc.aux_from_cache(whole.kv_scale[:, mine])[written]
        side_s = quant_tc.aux_from_cache(part.kv_scale)[written]
        layers.append({
            "cache_shape": list(part.kv_cache.shape),
            "side_shape": list(part.kv_scale.shape),
            "basis_equal": bool(torch.equal(part.k_basis, whole.k_basis[mine])),
            "slots_written": int(written.sum()),
            "code_bytes_apart": int((codes_w != codes_s).sum()),
            "side_bytes_apart": int((side_w != side_s).sum()),
            "compiled_bytes_apart": int((comp_part.kv_cache != part.kv_cache).sum())
            + int((comp_part.kv_scale != part.kv_scale).sum()),
        })  # fmt: skip
    return {
        "tc4": {
            "max_diff": max_diff(ref, eager),
            "compiled_diff": max_diff(eager, comp),
            "modes": [s.mode.value for s in shard.kv_specs],
            "layers": layers,
            "report": report_fused(),
        }
    }


def catch(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts on the type and message
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


def agreement(tp) -> dict:
    out: dict = {}
    kv = KVCacheConfig("fp8", skip_layers=(0,), page_size=4, **SCALES)
    # a rank built with another skip rule / scale: every rank raises, naming the value
    other = KVCacheConfig(
        "fp8", skip_layers=(0, 1) if tp.rank == 1 else (0,), page_size=4, **SCALES
    )
    out["skip_mismatch"] = catch(lambda: build_model("llama-tiny", other, prefix="mm", tp=tp))
    scaled = KVCacheConfig(
        "fp8", skip_layers=(0,), page_size=4, default_k_scale=0.05,
        default_v_scale=0.07 if tp.rank == 1 else 0.05,
    )  # fmt: skip
    out["scale_mismatch"] = catch(lambda: build_model("llama-tiny", scaled, prefix="ms", tp=tp))
    model = build_model("llama-tiny", kv, num_pages=8, dtype=torch.float32, prefix="rf", tp=tp)
    if tp.rank == 1:  # rank 1's cache is nearly full: it cannot take the batch
        model.allocator.append("other", 7 * 4)
    out["out_of_pages"] = catch(lambda: generate(model, [[1, 2, 3, 4, 5]], 2, prefill_logits=True))
    if tp.rank == 1:
        model.allocator.free("other")
    bad = [[1, 2, 999999]] if tp.rank == 1 else [[1, 2, 3]]
    out["bad_prompt"] = catch(lambda: generate(model, bad, 2, prefill_logits=True))
    diverged = [[1, 2, 3, 4]] if tp.rank == 1 else [[1, 2, 3]]
    out["different_batch"] = catch(lambda: generate(model, diverged, 2, prefill_logits=True))
    # calibrated scales: the amax over every rank's heads, the same as one process computes
    from torch_kvq.attention import calibrate_kv_scales

    whole = build_model("llama-tiny", kv, num_pages=8, dtype=torch.float32, prefix="whole")
    sample = [[3, 1, 4, 1, 5, 9, 2, 6]]
    out["scales"] = calibrate_kv_scales(
        model, lambda: generate(model, sample, 1, prefill_logits=True)
    )
    out["scales_whole"] = {
        n.replace("whole.", "rf."): v
        for n, v in calibrate_kv_scales(
            whole, lambda: generate(whole, sample, 1, prefill_logits=True)
        ).items()
    }
    res = generate(
        model, [[1, 2, 3, 4, 5]], 2, prefill_logits=True
    )  # after the refusals: both ranks still in step
    out["after"] = {"tokens": res.tokens, "free_pages": model.allocator.num_free_pages}
    out["refused_type"] = RankRefusedError.__name__
    return out


# the GPU scenarios' KV configs: FP8 per tensor on the global layers; issue 33's 4-bit modes
# (int4 on the global layers, k8v4 on sliding layer 0, the other sliding layers bf16)
GPU_KV = {
    "gpu": dict(kv_cache_dtype="fp8", skip_layers=("sliding_window",), **SCALES),
    "gpu4": dict(kv_cache_dtype="auto", layer_modes=(("full_attention", INT4), (0, K8V4))),
}


def gpu(tp, scenario: str) -> dict:
    """Compiled (kvq passes, Inductor) == eager on 2 GPUs (NCCL) with FlashInfer (the 4-bit
    layers: its kernel's Triton decode): a Gemma-3-style model in bf16, head size 128, the KV
    config ``GPU_KV[scenario]``."""
    from torch_kvq.attention.kernels import FlashInferKernel
    from torch_kvq.attention.kernels.flashinfer_jit import prebuild
    from torch_kvq.passes import kvq_backend

    kv = KVCacheConfig(page_size=16, **GPU_KV[scenario])
    dev = f"cuda:{torch.cuda.current_device()}"
    model = build_model("gemma3-tiny", kv, num_pages=64, device=dev, kernel=FlashInferKernel(),
                        tp=tp, head_dim=128, query_pre_attn_scalar=128)  # fmt: skip
    prebuild(model.kernel, model.kv_specs)
    prompts = [p * 4 for p in PROMPTS]  # longer than the window of 8
    eager = generate(model, prompts, 6, prefill_logits=True)
    forward = torch.compile(model, backend=kvq_backend, fullgraph=True)
    comp = generate(
        model, prompts, 6, forward=forward, force_tokens=eager.tokens, prefill_logits=True
    )
    return {
        "eager_tokens": eager.tokens,
        "compiled_tokens": comp.logits.argmax(-1).tolist(),
        "max_diff": max_diff(eager, comp),
        "scale": scale(eager),
        "quantized": sorted(s.name for s in model.kv_specs if s.is_quantized),
        "local_kv_heads": model.kv_specs[0].num_kv_heads,
        "report": report_fused(),
    }


def main() -> None:
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    on_gpu = scenario in GPU_KV
    tp = init_tensor_parallel(device="cuda" if on_gpu else "cpu")
    if not on_gpu:
        torch.set_num_threads(1)
    try:
        scenarios = {
            "parity": lambda: parity(tp),
            "agreement": lambda: agreement(tp),
            "modes": lambda: modes(tp, MAPS_8BIT),
            "modes4": lambda: modes(tp, MAPS_4BIT),
            "tc4": lambda: tc4(tp),
            "gpu": lambda: gpu(tp, "gpu"),
            "gpu4": lambda: gpu(tp, "gpu4"),
        }
        result = {"ok": True, **scenarios[scenario]()}
    except Exception:  # noqa: BLE001 - written for the test to show
        result = {"ok": False, "traceback": traceback.format_exc()}
    (out_dir / f"rank{tp.rank}.json").write_text(json.dumps(result, indent=1, default=str))
    # Both ranks have written; leave together and skip gloo's C++ teardown. A fresh-clone CI run
    # (2026-11-30, torch 2.13 CPU, 2 xdist workers) had rank 0 abort in it after writing a complete
    # result ("terminate called without an active exception", exit -6) once in two runs.
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
