"""The TMA decode (split grid and balanced schedule) over per-(token, head) caches: int8 or e4m3
codes with one fp32 scale per (token, kv head) (``kv_scale``), against the fp32 reference on the
dequantized cache.

CPU: Triton's interpreter (fp32 products; fp16 products too, where the int8 -> fp16 exponent
trick and the power-of-two pre-scale of the v scales run); GPU: the compiled kernel at its
defaults (fp16 products), both schedules, CUDA-graph replay, and V heads of very small and very
large magnitude. Without Triton every test here skips.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_case import (
    HAS_CUDA,
    LENS,
    ScaledCase,
    dense_table,
    rel_err,
    run_tma,
)

triton = pytest.importorskip("triton")  # after triton_case, which sets the interpreter first
tl = triton.language

from torch_kvq.attention.triton import decode_config  # noqa: E402
from torch_kvq.attention.triton.helpers import widen  # noqa: E402

MODES = ("int8", "fp8")


@triton.jit
def _widen_all(x_ptr, h_ptr, b_ptr, f_ptr):
    """256 int8 values widened to fp16, bf16 and fp32 (module level: the interpreter resolves a
    jit function's names in its module's globals)."""
    o = tl.arange(0, 256)
    x = tl.load(x_ptr + o)
    tl.store(h_ptr + o, widen(x, tl.float16))
    tl.store(b_ptr + o, widen(x, tl.bfloat16).to(tl.float32))
    tl.store(f_ptr + o, widen(x, tl.float32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qh,kh,d", [(8, 2, 128), (4, 2, 64)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (100, 5.0)], ids=["global", "swa_cap"])
@pytest.mark.parametrize("ppi,num_splits,lazy", [(1, 1, True), (2, 3, False), (4, 2, True)])
def test_interpreter_split_grid_matches_reference(
    interp, mode, qh, kh, d, window, soft_cap, ppi, num_splits, lazy
) -> None:
    case = ScaledCase(LENS, qh, kh, d, mode, seed=ppi)
    out = torch.empty(case.q.shape, dtype=torch.float32)
    kw = dict(window=window, soft_cap=soft_cap, dot_dtype=torch.float32, pages_per_iter=ppi)
    run_tma(case, interp, out=out, num_splits=num_splits, lazy_rescale=lazy, **kw)
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-4, f"rel err {err:.2e}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page", [32, 64])
def test_interpreter_larger_pages(interp, mode: str, page: int) -> None:
    """Pages of 32 and 64 tokens (the capability rows claim 16 to 64): the scale vector per page
    and the token masks follow the page size."""
    case = ScaledCase((1, 31, 65, 200), 8, 2, 64, mode, page=page, seed=page)
    out = torch.empty(case.q.shape, dtype=torch.float32)
    run_tma(case, interp, out=out, num_splits=2, dot_dtype=torch.float32, window=50)
    err = rel_err(out, case.ref(50))
    assert err < 5e-4, f"rel err {err:.2e}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nprog", [1, 5, 5000])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (100, 5.0)], ids=["global", "swa_cap"])
def test_interpreter_balanced_matches_reference(interp, programs, mode, nprog, window, soft_cap):
    programs(nprog)
    case = ScaledCase((1, 15, 16, 17, 300, 1000), 8, 2, 64, mode, seed=nprog)
    out = torch.full(case.q.shape, float("nan"), dtype=torch.float32)
    kw = dict(window=window, soft_cap=soft_cap, dot_dtype=torch.float32, programs_per_sm=1)
    run_tma(case, interp, out=out, **kw)
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-4, f"rel err {err:.2e}"  # NaN (a pair never written) fails too


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("v_gain", [1e-3, 1.0, 300.0])
def test_interpreter_fp16_products_and_v_prescale(interp, mode, lazy, v_gain) -> None:
    """fp16 products (the GPU default): int8 codes widened by the exponent trick, the v scales
    times 2^pv_shift before ``p @ v`` and the output divided back: accurate for V heads from
    1e-3 to 300 (fp16 subnormals below, overflow above, without the shift or with a larger one)."""
    case = ScaledCase((1, 17, 1000), 8, 2, 64, mode, seed=4, v_gain=v_gain)
    out = torch.empty(case.q.shape, dtype=torch.float32)
    run_tma(case, interp, out=out, num_splits=2, dot_dtype=torch.float16, lazy_rescale=lazy)
    assert torch.isfinite(out).all()
    err = rel_err(out, case.ref())
    assert err < 2e-3, f"rel err {err:.2e}"


def _widened(device: str) -> tuple[torch.Tensor, ...]:
    x = torch.arange(-128, 128, dtype=torch.int32, device=device).to(torch.int8)
    h = torch.empty(256, dtype=torch.float16, device=device)
    b, f = torch.empty(256, device=device), torch.empty(256, device=device)
    _widen_all[(1,)](x, h, b, f)
    return x.float(), h.float(), b, f


def test_int8_widening_is_exact(interp) -> None:
    """Every int8 value through ``helpers.widen`` to fp16 (the exponent trick) and to fp32 equals
    torch's conversion (bf16: GPU test; the interpreter has no bf16)."""
    want, h, _, f = _widened("cpu")
    assert torch.equal(h, want) and torch.equal(f, want)


def test_pv_shift_keeps_fp16_in_range() -> None:
    """Host arithmetic: with the shift, the largest weight times scale stays finite in fp16 for
    |v| up to 1790 (lazy: weights <= 2^8) and 28000 (eager: <= 1), and the smallest (a V head of
    absmax 0.5 lazy, 0.03 eager) in fp16's normal range."""
    from torch_kvq.attention.triton.decode_tma import pv_shift

    for code, qmax in ((torch.int8, 127.0), (torch.float8_e4m3fn, 448.0)):
        for lazy, p_max, top, low in ((True, 2.0**8, 1790.0, 0.5), (False, 1.0, 28000.0, 0.03)):
            s = 2.0 ** pv_shift(code, torch.float16, lazy)
            assert p_max * top / qmax * s < 65504, (code, lazy)
            assert p_max * 4 * top / qmax * s > 65504, (code, lazy)  # not needlessly small
            assert low / qmax * s >= 2.0**-14, (code, lazy)
        assert pv_shift(code, torch.bfloat16, True) == 0 == pv_shift(code, torch.float32, False)


def test_interpreter_rejects_bad_scales(interp) -> None:
    case = ScaledCase((5, 40), 8, 2, 64, "int8")
    with pytest.raises(ValueError, match=r"k_scale=0.5, v_scale=1.0 with kv_scale"):
        interp.paged_decode_tma(
            case.q, case.kv_cache, dense_table(case), case.seq_lens, 0.5, 1.0, case.sm_scale,
            max_seq_len=40, kv_scale=case.kv_scale,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"expected contiguous float32 \(7, 2, 2, 16\)"):
        run_tma(case, interp, kv_scale=case.kv_scale.transpose(2, 3).contiguous())
    with pytest.raises(ValueError, match=r"expected contiguous float32"):
        run_tma(case, interp, kv_scale=case.kv_scale.double())
    with pytest.raises(ValueError, match="an int8 cache needs its per-\\(token, head\\) kv_scale"):
        case.kv_scale, kv_scale = None, case.kv_scale
        case.k_scale = case.v_scale = 1.0
        run_tma(case, interp)
    bf16 = ScaledCase((5,), 8, 2, 64, "int8")
    bf16.kv_cache = bf16.kv_cache.to(torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache must hold codes"):
        run_tma(bf16, interp)
    assert kv_scale is not None


# -- GPU: the compiled kernel ---------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _gpu_case(mode: str, qh: int, kh: int, d: int, seed: int = 0, **gain) -> ScaledCase:
    return ScaledCase((*LENS, 4097), qh, kh, d, mode, device="cuda", seed=seed, **gain)


@pytest.mark.gpu
@needs_gpu
def test_gpu_int8_widening_is_exact() -> None:
    """The compiled exponent trick (fp16) and plain conversions (bf16, fp32), every int8 value."""
    want, h, b, f = _widened("cuda")
    assert torch.equal(h, want) and torch.equal(b, want) and torch.equal(f, want)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qh,kh,d", [(32, 8, 128), (16, 8, 256), (8, 8, 64)])
@pytest.mark.parametrize("num_splits", [1, None])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (64, 5.0)], ids=["global", "swa_cap"])
@pytest.mark.parametrize("ppi", [1, 2])
def test_gpu_split_grid_matches_reference(mode, qh, kh, d, num_splits, window, soft_cap, ppi):
    from torch_kvq.attention.triton import decode_tma

    case = _gpu_case(mode, qh, kh, d, seed=ppi)
    kw = dict(window=window, soft_cap=soft_cap, num_splits=num_splits, pages_per_iter=ppi)
    out = run_tma(case, decode_tma, **kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-3, f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("page", [32, 64])
@pytest.mark.parametrize("num_splits", [2, None])
def test_gpu_larger_pages(mode: str, d: int, page: int, num_splits: int | None) -> None:
    """The largest pages the capability rows claim (64) at head 256 fit shared memory at the
    tuned stages, on the split grid and the default schedule."""
    from torch_kvq.attention.triton import decode_tma

    case = ScaledCase((*LENS, 4097), 16, 8, d, mode, page=page, device="cuda", seed=page)
    out = run_tma(case, decode_tma, num_splits=num_splits)
    assert torch.isfinite(out).all()
    err = rel_err(out, case.ref())
    assert err < 5e-3, f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("qh,kh,d,per_sm,regs", [(32, 8, 128, 16, 128), (16, 8, 256, 8, None)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (64, 5.0)], ids=["global", "swa_cap"])
def test_gpu_balanced_matches_reference(mode, qh, kh, d, per_sm, regs, window, soft_cap):
    from torch_kvq.attention.triton import decode_tma

    case = _gpu_case(mode, qh, kh, d, seed=3)
    kw = dict(window=window, soft_cap=soft_cap, programs_per_sm=per_sm, max_registers=regs)
    out = run_tma(case, decode_tma, **{**decode_config.tuned(d), **kw})  # kw's cap
    assert torch.isfinite(out).all()
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-3, f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("math", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("v_gain", [1e-3, 1.0, 1000.0])
def test_gpu_v_magnitudes_stay_accurate(mode, math, v_gain) -> None:
    """Small V heads (fp16 subnormals without the pre-scale) and large ones (|v| ~ 4000: near the
    lazy rescale's overflow bound at head 128) at the defaults, in fp16 and bf16 products."""
    from torch_kvq.attention.triton import decode_tma

    case = _gpu_case(mode, 32, 8, 128, seed=5, v_gain=v_gain / 4 if v_gain > 1 else v_gain)
    out = run_tma(case, decode_tma, dot_dtype=math)
    assert torch.isfinite(out).all()
    err = rel_err(out, case.ref())
    assert err < (5e-3 if math == torch.float16 else 1e-2), f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("schedule", ["split", "balanced"])
def test_gpu_cuda_graph_replay_follows_new_lengths(mode: str, schedule: str) -> None:
    """Captured once; replays read seq_lens, the table and the scales from the device."""
    from torch_kvq.attention.triton import decode_balanced, decode_tma

    case = ScaledCase((1000, 1000, 1000), 32, 8, 128, mode, device="cuda", seed=6)
    out, table = torch.empty_like(case.q), dense_table(case)
    kw: dict = dict(out=out, **decode_config.tuned(128))
    if schedule == "split":
        kw.update(num_splits=4, workspace=tuple(
            torch.empty(s, device="cuda") for s in ((3, 32, 4, 128), (3, 32, 4))))  # fmt: skip
    else:
        n = decode_balanced.balanced_programs(case.q, 8, 1000, 16, 16)
        kw.update(programs_per_sm=16, max_registers=128, workspace=tuple(
            torch.empty(s, device="cuda") for s in ((n, 2, 4, 128), (n, 2, 4))))  # fmt: skip
    run = lambda: run_tma(case, decode_tma, table, **kw)  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in ((1, 500, 999), (1, 1, 2)):
        case.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        case.lens = lens
        case.kv_scale.mul_(2.0)  # new scales, same buffer: the graph reads them
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, case.ref()) < 5e-3, lens
