"""Issue 14's memory target on the CPU, and the at-scale benchmark and its plot in smoke mode.

The KV bytes are those of the real-size models built on the meta device (nothing allocated): on
Gemma-3-12B at 32 x 16k, windowed pools must stay within 10% of the ideal (global layers x context
+ sliding layers x window), where one shared table is 4.5x it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
from bench_decode_at_scale import MODELS, kv_configs  # noqa: E402
from kv_memory_report import allocated  # noqa: E402


@pytest.mark.parametrize("kv_name", ["bf16", "fp8"])
def test_gemma3_12b_windowed_pools_within_10_percent_of_ideal(kv_name):
    kv = kv_configs(MODELS["gemma-3-12b"][3])[kv_name]
    pooled = allocated("gemma-3-12b", kv, 32, 16384, windowed=True, chunk=1024)
    shared = allocated("gemma-3-12b", kv, 32, 16384, windowed=False, chunk=1024)
    assert pooled["bytes"] <= 1.10 * pooled["ideal"], (pooled["bytes"], pooled["ideal"])
    assert shared["bytes"] > 4 * pooled["ideal"]  # 40 of 48 layers hold 16k instead of 1k
    assert pooled["window_pages"] == {1024: 32 * (1024 // 16 + 1) + 1024 // 16 + 1}


def test_fp8_halves_global_layers_only():
    skip = MODELS["gemma-3-12b"][3]
    bf16, fp8 = (allocated("gemma-3-12b", kv, 32, 16384, True, 1024)["ideal"]
                 for kv in kv_configs(skip).values())  # fmt: skip
    global_bf16 = 8 * 32 * 16384 * 2 * 8 * 256 * 2  # 8 global layers, K and V, 8 heads of 256
    assert bf16 - fp8 == global_bf16 // 2


def test_inductor_patch_parses_known_keys_and_names_bad_ones():
    import argparse

    from bench_decode_at_scale import inductor_patch

    assert inductor_patch("combo_kernels=True") == {"combo_kernels": True}
    assert inductor_patch("triton.cudagraphs=False") == {"triton.cudagraphs": False}
    with pytest.raises(argparse.ArgumentTypeError, match="no_such_knob"):
        inductor_patch("no_such_knob=1")
    with pytest.raises(argparse.ArgumentTypeError, match="expected KEY=VALUE"):
        inductor_patch("combo_kernels")
    with pytest.raises(argparse.ArgumentTypeError, match="not a Python literal"):
        inductor_patch("combo_kernels=yes please")


def test_weights_kn_keeps_each_linear_and_its_output_and_lays_it_out_k_major():
    import torch
    from bench_decode_at_scale import weights_kn

    torch.manual_seed(0)
    emb = torch.nn.Embedding(11, 8)
    model = torch.nn.Sequential(
        emb, torch.nn.Linear(8, 12), torch.nn.GELU(), torch.nn.Linear(12, 8)
    )
    x = torch.tensor([[1, 4, 7]])
    want = model(x)
    assert weights_kn(model) == 2
    for lin in (model[1], model[3]):
        n, k = lin.weight.shape
        assert (n, k) == (lin.out_features, lin.in_features) and lin.weight.stride() == (1, n)
        assert isinstance(lin.weight, torch.nn.Parameter)
    assert model[0] is emb and emb.weight.is_contiguous()  # embeddings (tied or not) stay
    torch.testing.assert_close(model(x), want)


def test_smoke_run_and_plot(tmp_path):
    """CPU smoke run (tiny shapes, reference kernel) writes rows with the fields issue 14 lists,
    and the plot script draws them."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_decode_at_scale.py"), "--smoke",
           "--models", "gemma-3-12b", "--kv", "fp8:tc", "--commit", "test",
           "--fuse-projections", "--sample-clocks", "--weights-kn"]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
    rows = json.loads((tmp_path / "decode_at_scale.json").read_text())["rows"]
    need = {"model", "kv_config", "kernel", "batch", "ctx", "tokens_per_s", "step_ms", "kv_gib",
            "bound_tokens_per_s", "date", "gpu", "commit"}  # fmt: skip
    timed = [r for r in rows if "tokens_per_s" in r]
    assert timed and all(need <= set(r) for r in timed)
    assert all(r["fused_projections"] and r["max_autotune_gemm"] is False for r in rows)
    assert all(r["weights_kn"] and r["blas"] == "cublas" for r in rows)
    # --sample-clocks on CPU says so instead of making up clocks
    assert all(r["clocks"] == {"available": False, "why": "not on CUDA"} for r in timed)
    cap = next(r for r in rows if r["sweep"] == "capacity")
    assert cap["batch"] == cap["max_batch_at_capacity_ctx"] > 2 and cap["fits"]
    assert "error" not in cap, cap.get("error")
    flat = tmp_path / "rows.json"
    flat.write_text(json.dumps([{**r, "sweep": r["sweep"]} for r in rows]))
    png = tmp_path / "plot.png"
    plot = [
        sys.executable,
        str(ROOT / "benchmarks" / "plot_decode_at_scale.py"),
        str(flat),
        str(png),
    ]
    subprocess.run(plot, env=env, check=True, capture_output=True, timeout=120)
    assert png.stat().st_size > 10_000


def test_prefill_at_scale_smoke_run(tmp_path):
    """The TTFT benchmark's CPU smoke run: every variant timed, bf16/fa2 is its own reference,
    and the FP8 config's last-token logits differ from it (the cache really is FP8); with
    ``--profile`` each row carries the profiled prompt's GPU time by kernel kind (none on a CPU)."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_prefill_at_scale.py"), "--smoke",
           "--models", "llama-3.1-8b", "--commit", "test", "--profile"]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
    rows = json.loads((tmp_path / "prefill_at_scale.json").read_text())["rows"]
    assert [(r["kv_config"], r["prefill"]) for r in rows] == [
        ("bf16", "fa2"), ("bf16", "fa3"), ("fp8", "fa2"), ("fp8", "fa3"), ("fp8", "fa3_fp8")
    ]  # fmt: skip
    assert all("error" not in r and r["ttft_s"] > 0 for r in rows), rows
    assert all(r["gpu_ms_by_kind"] == {} and r["kernels"] == [] for r in rows), rows
    errs = {(r["kv_config"], r["prefill"]): r["logits_rel_err_vs_bf16_fa2"] for r in rows}
    assert errs[("bf16", "fa2")] == 0.0 and 0 < errs[("fp8", "fa2")] < 0.1


def test_prefill_at_scale_builds_every_variants_modules_in_one_batch(monkeypatch):
    """FlashInfer's modules for all variants go to one parallel build (run 22 of 2026-12-01 ran out
    of time building Gemma's fa3 modules variant by variant), each variant with its own KV specs."""
    import bench_prefill_at_scale as bench
    from bench_decode_at_scale import build

    from torch_kvq.attention.kernels import ReferenceKernel, flashinfer_jit

    class Spec:  # a JitSpec not yet compiled
        is_compiled = False

    asked, builds = [], []

    def jit_specs(kernel, specs, phases):
        quantized = sum(s.is_quantized for s in specs)
        asked.append((kernel.prefill, quantized, phases))
        return {f"{kernel.prefill}/{quantized}": Spec()}

    monkeypatch.setattr(flashinfer_jit, "jit_specs", jit_specs)
    monkeypatch.setattr(flashinfer_jit, "build", lambda mods, max_workers: builds.append(
        (sorted(mods), max_workers)))  # fmt: skip
    kvs = kv_configs(MODELS["gemma-3-12b"][3])
    model = build("gemma-3-12b", kvs["bf16"], ReferenceKernel(), "cpu", True, 8, None)
    bench.prebuild_all(model, kvs, bench.VARIANTS)
    n_global = 1  # the smoke Gemma: 5 sliding layers, 1 global (the FP8 one)
    assert asked == [("fa2", 0, ("prefill",)), ("fa3", 0, ("prefill",)),
                     ("fa2", n_global, ("prefill",)), ("fa3", n_global, ("prefill",)),
                     ("fa3_fp8", n_global, ("prefill",))]  # fmt: skip
    assert len(builds) == 1 and builds[0] == (sorted(f"{p}/{q}" for p, q, _ in asked), 5)


def test_kv_config_names_and_refusal():
    from bench_decode_at_scale import KV_CONFIGS, MIXED, kv_config

    skip = MODELS["llama-3.1-8b"][3]
    assert kv_config("fp8", "llama-3.1-8b") == kv_configs(skip)["fp8"]
    assert kv_config("bf16", "gemma-3-12b") == kv_configs(skip)["bf16"]
    assert set(MIXED) == set(MODELS) and KV_CONFIGS[:2] == ("bf16", "fp8")
    with pytest.raises(ValueError, match=r"unknown kv config 'int2'; expected one of \['bf16'"):
        kv_config("int2", "llama-3.1-8b")


def test_int4_recommended_config_resolves_on_both_shapes():
    """The preset on the at-scale shapes: Llama 8 of 32 layers k8v4 (SmolLM2's measured layers),
    the rest int4; Gemma-3-12B every full-attention layer k8v4, its sliding layers bf16."""
    from bench_decode_at_scale import RECOMMENDED_LAYERS, kv_config

    from torch_kvq.spec import AttentionLayerInfo
    from torch_kvq.spec_resolve import resolve_layer_specs

    assert set(RECOMMENDED_LAYERS) == set(MODELS)
    llama = [AttentionLayerInfo(f"l{i}", 32, 8, 128) for i in range(32)]
    modes = [
        s.mode.value
        for s in resolve_layer_specs(kv_config("int4-recommended", "llama-3.1-8b"), llama)
    ]
    assert modes.count("k8v4_per_token_head") == 8 and modes.count("int4_per_token_head") == 24
    gemma = [AttentionLayerInfo(f"l{i}", 16, 8, 256, sliding_window=None if i % 6 == 5 else 1024)
             for i in range(48)]  # fmt: skip
    specs = resolve_layer_specs(kv_config("int4-recommended", "gemma-3-12b"), gemma)
    assert [s.index for s in specs if s.is_quantized] == list(range(5, 48, 6))
    assert {s.mode.value for s in specs if s.is_quantized} == {"k8v4_per_token_head"}


def test_int4_recommended_config_resolves_on_the_smoke_shapes():
    """``--smoke`` builds the preset on the few layers of ``SMOKE``'s shapes (the full shapes'
    sensitive layers past the last one refused the map): k8v4 on ``SMOKE_LAYERS``, in range."""
    from bench_decode_at_scale import SMOKE, SMOKE_LAYERS, kv_config

    from torch_kvq.spec import AttentionLayerInfo
    from torch_kvq.spec_resolve import resolve_layer_specs

    n = SMOKE["llama-3.1-8b"]["num_hidden_layers"]
    llama = [AttentionLayerInfo(f"l{i}", 32, 8, 128) for i in range(n)]
    specs = resolve_layer_specs(kv_config("int4-recommended", "llama-3.1-8b", smoke=True), llama)
    assert [s.index for s in specs if s.mode.value == "k8v4_per_token_head"] == [1, 3]
    with pytest.raises(ValueError, match="layer_modes index 4 is out of range for a model with 4"):
        resolve_layer_specs(kv_config("int4-recommended", "llama-3.1-8b"), llama)
    gemma_types = SMOKE["gemma-3-12b"]["layer_types"]
    gemma = [AttentionLayerInfo(f"l{i}", 16, 8, 256,
                                sliding_window=32 if t == "sliding_attention" else None)
             for i, t in enumerate(gemma_types)]  # fmt: skip
    specs = resolve_layer_specs(kv_config("int4-recommended", "gemma-3-12b", smoke=True), gemma)
    assert [s.index for s in specs if s.is_quantized] == list(SMOKE_LAYERS["gemma-3-12b"])


def test_tc4_config_resolves_with_a_basis_on_every_layer():
    """``tc4_per_token_head-all``: tc4 on every Llama layer, each with a seeded orthogonal K basis
    of its shape (the step's cost does not depend on the values); 152 bytes a token and kv head."""
    from bench_decode_at_scale import kv_config

    from torch_kvq.spec import AttentionLayerInfo
    from torch_kvq.spec_resolve import resolve_layer_specs

    llama = [AttentionLayerInfo(f"l{i}", 32, 8, 128) for i in range(32)]
    specs = resolve_layer_specs(kv_config("tc4_per_token_head-all", "llama-3.1-8b"), llama)
    assert {s.mode.value for s in specs} == {"tc4_per_token_head"}
    p = specs[5].k_basis.matrix()
    assert p.shape == (8, 128, 128)
    torch.testing.assert_close(p[0] @ p[0].T, torch.eye(128), atol=1e-5, rtol=0)
    assert specs[0].cache_bytes_per_token == 8 * 152
