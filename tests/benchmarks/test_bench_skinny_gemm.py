"""bench_skinny_gemm: its shapes are the models' projections; the split-K kernel against torch in
Triton's interpreter (a subprocess: the interpreter is set before Triton is imported; skipped
where Triton is not installed, as in CI)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_decode_at_scale import GEMMA3_12B, LLAMA_8B  # noqa: E402
from bench_skinny_gemm import SHAPES, gemm_bytes, shapes  # noqa: E402


@pytest.mark.parametrize("model,cfg", [("llama-3.1-8b", LLAMA_8B), ("gemma-3-12b", GEMMA3_12B)])
def test_shapes_are_the_fused_projections(model: str, cfg: dict) -> None:
    hidden, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    qh, kh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    projections, _ = SHAPES[model]
    assert projections == {
        "qkv": (hidden, (qh + 2 * kh) * d), "o": (qh * d, hidden),
        "gate_up": (hidden, 2 * inter), "down": (inter, hidden),
    }  # fmt: skip
    assert gemm_bytes(32, 4096, 3840) == 2 * (3840 * 4096 + 32 * 4096 + 32 * 3840)


def test_shapes_walks_models_projections_and_rows() -> None:
    every = list(shapes(list(SHAPES), None, None))
    assert len(every) == sum(len(p) * len(ms) for p, ms in SHAPES.values()) == 16
    assert list(shapes(["gemma-3-12b"], ["o"], None)) == [
        ("gemma-3-12b", "o", 4096, 3840, 32), ("gemma-3-12b", "o", 4096, 3840, 131),
    ]  # fmt: skip
    assert [m for *_, m in shapes(["llama-3.1-8b"], ["qkv", "down"], [8])] == [8, 8]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_smoke_split_k_matches_torch() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_skinny_gemm.py"), "--smoke"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "splitk[bn32,bk32,s4,st2]" in out.stdout and "'cublas_kn'" in out.stdout


def test_blas_paths_compute_the_projection_and_restore_the_preference(monkeypatch) -> None:
    import bench_skinny_gemm
    import torch
    from bench_skinny_gemm import BLAS, blas_paths

    pref = ["cublas"]  # a CPU build refuses cuBLASLt: the preference is faked, its use recorded
    during: list[str] = []

    def preferred(backend: str | None = None) -> str:
        if backend is not None:
            pref[0] = backend
        return pref[0]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    x, w = torch.randn(5, 24, dtype=torch.float64), torch.randn(16, 24, dtype=torch.float64)
    paths = blas_paths(x)
    assert sorted(paths) == sorted(BLAS)
    for name, (fn, kn) in paths.items():
        assert kn == name.endswith("_kn")
        wrapped = bench_skinny_gemm.with_blas(
            name.removesuffix("_kn"), lambda: during.append(pref[0])
        )
        wrapped()
        torch.testing.assert_close(fn(w.t().contiguous() if kn else w), x @ w.t())
        assert pref == ["cublas"]  # put back after each call
    assert during == ["cublas", "cublaslt", "cublas", "cublaslt"]
    assert list(blas_paths(x, ("cublas",))) == ["cublas", "cublas_kn"]
