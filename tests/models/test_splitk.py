"""Split-K GEMMs for skinny projections: the op's partials, ``SplitKLinear``'s routing by rows,
``use_split_k`` on our models (eager and compiled: the partials' sum fuses into the consumer) and,
on a GPU, the Triton kernel against cuBLAS at the models' shapes and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_kvq.models.splitk as splitk_module
from torch_kvq import KVCacheConfig
from torch_kvq.models import SplitKConfig, SplitKLinear, build_model, generate, use_split_k
from torch_kvq.models.splitk import split_bounds, splitk_partials
from torch_kvq.passes import make_kvq_backend

FP8 = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=4)
PROMPTS = [[1, 2, 3, 4, 5], [7] * 11, [9, 8]]
ALL = {"qkv_proj": SplitKConfig(4, block_k=16), "o_proj": SplitKConfig(3, block_k=16),
       "gate_up_proj": SplitKConfig(2, block_k=32), "down_proj": SplitKConfig(8, block_k=16)}  # fmt: skip


@pytest.mark.parametrize(
    "k,splits,block_k", [(4096, 4, 128), (100, 3, 16), (48, 8, 16), (7, 2, 16)]
)
def test_split_bounds_tile_k_in_whole_blocks(k: int, splits: int, block_k: int) -> None:
    bounds = split_bounds(k, splits, block_k)
    assert len(bounds) == splits and bounds[0][0] == 0 and bounds[-1][1] == k
    assert all(a == prev_b for (_, prev_b), (a, _) in zip(bounds, bounds[1:]))
    assert all((b - a) % block_k == 0 for a, b in bounds if b < k)


def test_partials_sum_to_the_product() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 100, generator=g), torch.randn(24, 100, generator=g)
    p = splitk_partials(x, w, 3, 64, 16, 4)
    assert p.shape == (3, 5, 24) and p.dtype == torch.float32
    for part, (a, b) in zip(p, split_bounds(100, 3, 16)):
        torch.testing.assert_close(part, x[:, a:b] @ w[:, a:b].T)
    torch.testing.assert_close(p.sum(0), x @ w.T, rtol=1e-5, atol=1e-5)
    empty = splitk_partials(x[:, :20], w[:, :20], 8, 64, 16, 4)  # splits past K are zeros
    assert torch.count_nonzero(empty[2:]) == 0 and torch.count_nonzero(empty[:2]) > 0


def test_opcheck() -> None:
    x, w = torch.randn(3, 40).bfloat16(), torch.randn(16, 40).bfloat16()
    torch.library.opcheck(torch.ops.kvq_models.splitk_partials.default, (x, w, 2, 64, 16, 4))


@pytest.mark.parametrize(
    "x,w,match",
    [
        (torch.randn(2, 8), torch.randn(4, 9), "x \\[M, K\\] and w \\[N, K\\]"),
        (torch.randn(2, 8), torch.randn(4, 8).bfloat16(), "share dtype"),
        (torch.randn(8, 2).T, torch.randn(4, 8), "contiguous rows"),
    ],
)
def test_bad_operands_are_named(x, w, match) -> None:
    with pytest.raises(ValueError, match=match):
        splitk_partials(x, w, 2, 64, 16, 4)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(splits=0), "splits must be a positive int, got 0"),
        (dict(splits=9), "splits 9 > 8"),
        (dict(splits=2, block_n=48), "block_n must be a power of 2 >= 16, got 48"),
        (dict(splits=2, block_k=8), "block_k must be a power of 2 >= 16, got 8"),
        (dict(splits=2, max_rows=True), "max_rows must be a positive int, got True"),
    ],
)
def test_config_is_checked(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        SplitKConfig(**kw)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_takes_split_k_up_to_max_rows(bias: bool, monkeypatch) -> None:
    lin = nn.Linear(64, 40, bias=bias, dtype=torch.bfloat16)
    sk = SplitKLinear(lin, SplitKConfig(4, block_k=16, max_rows=8))
    assert sk.weight is lin.weight and sk.bias is lin.bias
    rows: list[int] = []
    real = splitk_module.splitk_partials

    def spy(*args):
        rows.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(splitk_module, "splitk_partials", spy)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    want = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    got = sk(x)
    assert rows == [8] and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    big = torch.randn(9, 64, dtype=torch.bfloat16)
    assert torch.equal(sk(big), lin(big)) and rows == [8]  # 9 rows > max_rows: F.linear


@pytest.mark.parametrize("preset", ["gemma3-tiny", "llama-tiny"])
def test_models_with_split_k_match_eager_and_compiled(preset: str) -> None:
    plain = build_model(preset, FP8, seed=3, dtype=torch.float32)
    model = build_model(preset, FP8, seed=3, dtype=torch.float32)
    plain.fuse_projections()
    model.fuse_projections()
    assert use_split_k(model, ALL) == 4 * len(model.layers)
    assert isinstance(model.layers[0].self_attn.o_proj, SplitKLinear)
    a = generate(plain, PROMPTS, 3)
    b = generate(model, PROMPTS, 3)  # 18 prefill rows and 3 decode rows: all split-K
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-4)
    backend = make_kvq_backend()  # Inductor: the partials' sum fused into the consumers
    torch._dynamo.reset()
    try:
        compiled = generate(
            model, PROMPTS, 3, forward=torch.compile(model, backend=backend), force_tokens=b.tokens
        )
    finally:
        torch._dynamo.reset()
    assert compiled.tokens == b.tokens
    torch.testing.assert_close(compiled.logits, b.logits, rtol=1e-3, atol=1e-3)


def test_use_split_k_names_what_it_cannot_replace() -> None:
    model = build_model("llama-tiny", FP8)
    with pytest.raises(ValueError, match=r"no nn.Linear named \['qkv_proj'\].*'o_proj'"):
        use_split_k(model, {"qkv_proj": SplitKConfig(2)})  # not fused: q/k/v_proj
    holder = nn.Module()
    holder.o_proj = SplitKLinear(nn.Linear(8, 8), SplitKConfig(2))
    with pytest.raises(ValueError, match="o_proj is a SplitKLinear, expected a plain nn.Linear"):
        use_split_k(holder, {"o_proj": SplitKConfig(2)})


# --- GPU: the Triton kernel ---------------------------------------------------------------------

SHAPES = [
    (32, 4096, 3840),
    (32, 3840, 8192),
    (110, 4096, 4096),
    (131, 15360, 3840),
    (7, 4096, 6144),
]
CONFIGS = [SplitKConfig(4), SplitKConfig(8, block_n=32), SplitKConfig(2, 128, 64, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("cfg", CONFIGS)
def test_gpu_kernel_matches_cublas(m: int, k: int, n: int, cfg: SplitKConfig) -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    p = splitk_partials(x, w, cfg.splits, cfg.block_n, cfg.block_k, cfg.stages)
    for part, (a, b) in zip(p, split_bounds(k, cfg.splits, cfg.block_k)):
        want = F.linear(x[:, a:b].float(), w[:, a:b].float())
        torch.testing.assert_close(part, want, rtol=2e-3, atol=2e-3)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    got = SplitKLinear(lin, cfg)(x)
    ref = F.linear(x.float(), w.float())
    assert got.dtype == torch.bfloat16
    assert float((got.float() - ref).norm() / ref.norm()) < 4e-3  # one bf16 rounding


@pytest.mark.gpu
def test_gpu_split_k_replays_in_a_cuda_graph() -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lin = nn.Linear(4096, 3840, bias=True, device="cuda", dtype=torch.bfloat16)
    sk = SplitKLinear(lin, SplitKConfig(4))
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    sk(x)  # build the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sk(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    ref = lin(x).float()
    assert float((out.float() - ref).norm() / ref.norm()) < 4e-3
