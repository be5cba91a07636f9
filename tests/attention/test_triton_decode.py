"""The Triton split-K FP8 decode kernel against the reference attention on the same FP8 cache.

CPU: Triton's interpreter runs the kernel (a private copy of the module loaded with
``TRITON_INTERPRET=1``). Its ``tl.dot`` on bf16 operands returns garbage (numpy has no bf16), so
CPU runs take the q.k product in fp32 (the fp16 p.v product and the FP8 widening are the GPU
code); the default bf16 q.k runs in the GPU tests. Without Triton every test here skips.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Triton reads TRITON_INTERPRET when it is imported and when a kernel is decorated: set it before
if not HAS_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="needs triton (the CPU test venv has none; GPU gate runs it)")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

from torch_kvq.attention.kernels.reference import ref_attention  # noqa: E402
from torch_kvq.spec import FP8_DTYPE  # noqa: E402

K_SCALE, V_SCALE = 1 / 16, 1 / 8
LENS = (1, 15, 16, 17, 1000)


@pytest.fixture(scope="module")
def interp() -> ModuleType:
    """triton_decode with interpreted kernels (CPU only; CUDA runs the compiled kernel below)."""
    if not INTERPRETING:
        pytest.skip(
            "interpreter tests run on a machine without CUDA, in a process that had not "
            "imported triton yet (the gpu tests cover the compiled kernel)"
        )
    from torch_kvq.attention.kernels import triton_decode

    return triton_decode


class Case:
    """A paged cache of ``cache_dtype`` with shuffled pages (unused ones hold NaN-free noise),
    queries, and metadata; ``ref()`` is dense fp32 attention on the dequantized cache."""

    def __init__(
        self,
        lens: tuple[int, ...],
        qh: int,
        kh: int,
        d: int,
        page: int = 16,
        cache_dtype: torch.dtype = FP8_DTYPE,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lens, self.qh, self.kh, self.d, self.page = lens, qh, kh, d, page
        n_pages = [max(1, -(-n // page)) for n in lens]
        total = sum(n_pages) + 3  # spare pages: never read
        cache = torch.randn((total, 2, page, kh, d), generator=g) * 8
        self.kv_cache = cache.to(cache_dtype).to(device)
        perm = torch.randperm(total, generator=g)[: sum(n_pages)]
        self.kv_indices = perm.to(torch.int32).to(device)
        indptr = torch.tensor([0, *n_pages]).cumsum(0)
        self.kv_indptr = indptr.to(torch.int32).to(device)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.q = (torch.randn((len(lens), qh, d), generator=g) * 2).to(torch.bfloat16).to(device)
        self.sm_scale = d**-0.5

    def ref(self, window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
        outs = []
        for b, n in enumerate(self.lens):
            ids = self.kv_indices[self.kv_indptr[b] : self.kv_indptr[b + 1]].long()
            pages = self.kv_cache[ids].float()
            k = pages[:, 0].reshape(-1, self.kh, self.d)[:n] * K_SCALE
            v = pages[:, 1].reshape(-1, self.kh, self.d)[:n] * V_SCALE
            pos = torch.arange(n, device=k.device)
            qb = self.q[b : b + 1]
            outs.append(ref_attention(qb, k, v, pos[-1:], pos, self.sm_scale, window, soft_cap))
        return torch.cat(outs)

    def run(self, mod: ModuleType, **kw) -> torch.Tensor:
        return mod.paged_decode_fp8(
            self.q, self.kv_cache, self.kv_indptr, self.kv_indices, self.seq_lens,
            K_SCALE, V_SCALE, self.sm_scale, max_seq_len=max(self.lens), **kw,
        )  # fmt: skip


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


CPU_DOTS = dict(qk_dtype=torch.float32, pv_dtype=torch.float16)


# -- CPU, Triton's interpreter ------------------------------------------------------------------


@pytest.mark.parametrize(
    "qh,kh,d",
    [(4, 4, 64), (8, 2, 128), (16, 2, 64), (4, 2, 256)],
    ids=["g1_d64", "g4_d128", "g8_d64", "g2_d256"],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_interpreter_matches_reference(interp, qh: int, kh: int, d: int, num_splits: int) -> None:
    case = Case(LENS, qh, kh, d)
    out = torch.empty(case.q.shape, dtype=torch.float32)
    case.run(interp, out=out, num_splits=num_splits, block_n=32, **CPU_DOTS)
    err = rel_err(out, case.ref())
    assert err < 5e-4, f"rel err {err:.2e}"


@pytest.mark.parametrize(
    "window,soft_cap", [(64, None), (None, 5.0), (100, 5.0), (1, None)], ids=str
)
def test_interpreter_window_and_soft_cap(interp, window, soft_cap) -> None:
    case = Case(LENS, 8, 2, 64, seed=1)
    out = torch.empty(case.q.shape, dtype=torch.float32)
    case.run(
        interp, out=out, window=window, soft_cap=soft_cap, num_splits=4, block_n=16, **CPU_DOTS
    )
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-4, f"rel err {err:.2e}"


def test_interpreter_bf16_output_bf16_cache_and_empty_splits(interp) -> None:
    """bf16 output (the default), a bf16 cache through the same kernel, and more splits than
    tiles (splits with no tokens must drop out of the merge)."""
    for cache_dtype in (FP8_DTYPE, torch.bfloat16):
        case = Case((1, 17, 40), 8, 2, 64, cache_dtype=cache_dtype, seed=2)
        out = case.run(interp, num_splits=8, block_n=16, workspace=None, **CPU_DOTS)
        assert out.dtype == torch.bfloat16 and out.shape == case.q.shape
        err = rel_err(out, case.ref())
        assert err < 6e-3, f"{cache_dtype}: rel err {err:.2e}"


def test_interpreter_default_splits_and_workspace(interp) -> None:
    case = Case((300, 5), 8, 4, 64, seed=3)
    s = interp.default_num_splits(2, 4, 300, 32, sms=132)
    assert s == 2  # wants 66 splits, 300 tokens only fill 2 splits of 8 x 32-token tiles
    ws = (torch.empty(2, 8, s, 64), torch.empty(2, 8, s))
    out = torch.empty(case.q.shape, dtype=torch.float32)
    case.run(interp, out=out, block_n=32, workspace=ws, **CPU_DOTS)
    assert rel_err(out, case.ref()) < 1e-3


def test_fp8_widening_is_exact(interp) -> None:
    """Every e4m3 bit pattern (NaN aside) widened in-kernel equals torch's conversion."""
    import triton
    import triton.language as tl

    @triton.jit
    def widen(x_ptr, y_ptr, z_ptr):
        o = tl.arange(0, 256)
        x = tl.load(x_ptr + o)
        tl.store(y_ptr + o, x.to(tl.bfloat16).to(tl.float32))
        tl.store(z_ptr + o, x.to(tl.float16).to(tl.float32))

    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    x = bits.view(FP8_DTYPE)
    y, z = torch.empty(256), torch.empty(256)
    widen[(1,)](x, y, z)
    want = x.float()
    keep = ~want.isnan()
    assert torch.equal(y[keep], want[keep]) and torch.equal(z[keep], want[keep])


def test_rejects_bad_inputs(interp) -> None:
    case = Case((5,), 6, 4, 64)
    with pytest.raises(ValueError, match="QH % KH"):
        case.run(interp)
    case = Case((5,), 8, 4, 64)
    with pytest.raises(ValueError, match="block_n"):
        case.run(interp, block_n=24)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        interp.paged_decode_fp8(
            case.q, case.kv_cache, case.kv_indptr, case.kv_indices, case.seq_lens.long(),
            1.0, 1.0, 0.1, max_seq_len=5,
        )  # fmt: skip
    with pytest.raises(ValueError, match="window must be positive"):
        case.run(interp, window=0)


# -- GPU: the compiled kernel, default (bf16 q.k, fp16 p.v) math ---------------------------------

needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _cuda_case(lens, qh, kh, d, seed=0) -> Case:
    return Case(lens, qh, kh, d, device="cuda", seed=seed)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qh,kh,d", [(32, 8, 128), (16, 8, 256), (8, 8, 64), (64, 8, 128)])
@pytest.mark.parametrize("num_splits", [1, 4, None])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (64, 5.0)], ids=["global", "swa_cap"])
def test_gpu_matches_reference(qh, kh, d, num_splits, window, soft_cap) -> None:
    from torch_kvq.attention.kernels import triton_decode

    case = _cuda_case((*LENS, 4097), qh, kh, d)
    out = case.run(triton_decode, num_splits=num_splits, window=window, soft_cap=soft_cap)
    ref = case.ref(window, soft_cap)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < 5e-3, f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("block_n,num_warps,num_stages", [(16, 4, 2), (64, 4, 3), (128, 8, 2)])
def test_gpu_tiling_sweep_matches_reference(block_n, num_warps, num_stages) -> None:
    from torch_kvq.attention.kernels import triton_decode

    case = _cuda_case(LENS, 32, 8, 128, seed=4)
    out = torch.empty(case.q.shape, dtype=torch.float32, device="cuda")
    case.run(
        triton_decode, out=out, num_splits=3, block_n=block_n,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    assert rel_err(out, case.ref()) < 2e-3


@pytest.mark.gpu
@needs_gpu
def test_gpu_cuda_graph_replay_follows_new_lengths() -> None:
    """Captured once; replays read seq_lens / page tables from the device (no baked lengths)."""
    from torch_kvq.attention.kernels import triton_decode

    case = _cuda_case((1000, 1000, 1000), 32, 8, 128, seed=5)
    ws = tuple(torch.empty(s, device="cuda") for s in ((3, 32, 4, 128), (3, 32, 4)))
    out = torch.empty_like(case.q)
    run = lambda: case.run(triton_decode, out=out, num_splits=4, workspace=ws)  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    case.seq_lens.copy_(torch.tensor([1, 500, 999], dtype=torch.int32))
    case.lens = (1, 500, 999)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, case.ref()) < 5e-3
