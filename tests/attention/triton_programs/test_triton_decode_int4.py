"""The TMA decode (split grid and balanced schedule) reading an ``int4_per_token_head`` cache in
place: packed rotated codes [P, 2, page, KH, D / 2] uint8 written by ``quant.quantize_int4_rotated``
from random k / v, fp32 scales with the zero point in their low bits, q rotated in the prologue
and the output un-rotated in the epilogue (``attention/triton/int4.py``), against fp32 attention
over the cache dequantized and un-rotated (the model's basis).

CPU: Triton's interpreter (fp32 products; fp16 products too, where the nibble exponent trick, the
pre-scaled v scales and the fp16 un-rotation run); GPU: the compiled kernel at its defaults (fp16
products, the inline-PTX unpack), both schedules, CUDA-graph replay. Without Triton every test
here skips.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_case import HAS_CUDA, LENS, ScaledCase, dense_table, rel_err, run_tma

triton = pytest.importorskip("triton")  # after triton_case, which sets the interpreter first
tl = triton.language

from torch_kvq.attention import rotation  # noqa: E402
from torch_kvq.attention.triton import decode_config  # noqa: E402
from torch_kvq.attention.triton.int4 import (  # noqa: E402
    rotation_matrices,
    unpack,
    unpack_centred,
)


@triton.jit
def _unpack_all(x_ptr, lo_ptr, hi_ptr, DOT: tl.constexpr):
    """Every byte (rows, 16 copies each): [256, 16] low code + A, 16 * high code + A."""
    r = tl.arange(0, 256)
    c = tl.arange(0, 16)
    x = tl.load(x_ptr + r[:, None] * 16 + c[None, :])
    lo, hi = unpack(x, DOT)
    tl.store(lo_ptr + r[:, None] * 16 + c[None, :], lo.to(tl.float32))
    tl.store(hi_ptr + r[:, None] * 16 + c[None, :], hi.to(tl.float32))


@triton.jit
def _unpack_centred_all(x_ptr, zp_ptr, lo_ptr, hi_ptr, DOT: tl.constexpr):
    """Every byte against every zero point: [256, 16] (byte row, zero point column)."""
    r = tl.arange(0, 256)
    c = tl.arange(0, 16)
    x = tl.load(x_ptr + r[:, None] * 16 + c[None, :])
    lo, hi = unpack_centred(x, tl.load(zp_ptr + c)[None, :], DOT)
    tl.store(lo_ptr + r[:, None] * 16 + c[None, :], lo.to(tl.float32))
    tl.store(hi_ptr + r[:, None] * 16 + c[None, :], hi.to(tl.float32))


def _check_centred(device: str, dot: tl.dtype) -> None:
    x = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    x = x[:, None].expand(256, 16).contiguous()
    zp = torch.arange(16, dtype=torch.int32, device=device)  # as _split_scale gives them
    lo, hi = torch.empty(256, 16, device=device), torch.empty(256, 16, device=device)
    _unpack_centred_all[(1,)](x, zp, lo, hi, dot)
    assert torch.equal(lo, (x & 0xF).float() - zp), dot
    assert torch.equal(hi, ((x >> 4).float() - zp) * 16), dot


def _unpacked(device: str, dot: tl.dtype) -> tuple[torch.Tensor, ...]:
    x = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    x = x[:, None].expand(256, 16).contiguous()
    lo, hi = torch.empty(256, 16, device=device), torch.empty(256, 16, device=device)
    _unpack_all[(1,)](x, lo, hi, dot)
    a = 1024.0 if dot == tl.float16 else 0.0  # int4.offset
    want_lo = (x & 0xF).float() + a
    want_hi = (x >> 4).float() * 16 + a
    return lo, hi, want_lo, want_hi


def _case(lens, qh, kh, d, page=16, device="cpu", seed=0, **gain) -> ScaledCase:
    return ScaledCase(lens, qh, kh, d, "int4", page=page, device=device, seed=seed, **gain)


def test_rotation_matrices_rotate_and_unrotate() -> None:
    """Host operands: the last D values are the rotation's signs (``rotate_q``'s butterfly), and U
    (rows in V's column order, even then odd) applied to ``rotation.rotate(q)``'s even and odd
    channels gives q back."""
    from torch_kvq.attention.triton.int4 import v_columns

    for d in (32, 64, 128, 256):
        ops = rotation_matrices(d, torch.device("cpu")).float()
        u, signs = ops[: d * d].view(d, d), ops[d * d :]
        assert torch.equal(signs, rotation.hadamard_signs(d).float())
        assert set(u.unique().tolist()) == {-1.0, 1.0}
        q = torch.randn(5, d, dtype=torch.float64)
        rq = rotation.rotate(q.float()).double()
        perm = v_columns(d)
        halves = torch.cat((rq[:, 0::2][:, perm], rq[:, 1::2][:, perm]), 1)
        assert torch.allclose(halves @ u.double() * d**-0.5, q, atol=1e-5)
        assert sorted(perm.tolist()) == list(range(d // 2))


def test_unpack_is_exact(interp) -> None:
    """Every byte through ``int4.unpack``: fp16 (the exponent trick) and fp32 equal ``code + A``
    and ``16 * code + A`` exactly (bf16: GPU test; the interpreter has no bf16)."""
    for dot in (tl.float16, tl.float32):
        lo, hi, want_lo, want_hi = _unpacked("cpu", dot)
        assert torch.equal(lo, want_lo) and torch.equal(hi, want_hi), dot


def test_unpack_centred_is_exact(interp) -> None:
    """V's unpack: every byte against every zero point, ``code - zp`` and ``16 (code - zp)``."""
    for dot in (tl.float16, tl.float32):
        _check_centred("cpu", dot)


# (qh, kh, d): GQA groups 1, 4 and 8 at heads 64, 128, 256
SHAPES = [(4, 4, 64), (8, 2, 128), (16, 2, 256)]


@pytest.mark.parametrize("qh,kh,d", SHAPES, ids=["g1_d64", "g4_d128", "g8_d256"])
@pytest.mark.parametrize(
    "window,soft_cap,ppi,num_splits,lazy",
    [(None, None, 1, 1, True), (100, 5.0, 2, 3, False), (None, 5.0, 4, 2, True)],
    ids=["global_1split", "swa_cap_3splits_ppi2", "cap_2splits_ppi4"],
)
def test_interpreter_split_grid_matches_reference(
    interp, qh, kh, d, window, soft_cap, ppi, num_splits, lazy
) -> None:
    case = _case(LENS, qh, kh, d, seed=ppi)
    out = torch.empty(case.q.shape, dtype=torch.float32)
    kw = dict(window=window, soft_cap=soft_cap, dot_dtype=torch.float32, pages_per_iter=ppi)
    run_tma(case, interp, out=out, num_splits=num_splits, lazy_rescale=lazy, **kw)
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-4, f"rel err {err:.2e}"


@pytest.mark.parametrize("page", [32, 64])
def test_interpreter_larger_pages(interp, page: int) -> None:
    """Pages of 32 and 64 tokens: the scale and zero-point vectors per page follow the size."""
    case = _case((1, 31, 65, 200), 8, 2, 64, page=page, seed=page)
    out = torch.empty(case.q.shape, dtype=torch.float32)
    run_tma(case, interp, out=out, num_splits=2, dot_dtype=torch.float32, window=50)
    err = rel_err(out, case.ref(50))
    assert err < 5e-4, f"rel err {err:.2e}"


@pytest.mark.parametrize("nprog", [1, 5, 300])  # 300: more programs than the 174 pages
@pytest.mark.parametrize("window,soft_cap", [(None, None), (100, 5.0)], ids=["global", "swa_cap"])
def test_interpreter_balanced_matches_reference(interp, programs, nprog, window, soft_cap):
    """The balanced schedule: whole pairs written un-rotated by their program, cut pairs'
    partials un-rotated before ``_combine_balanced`` merges them."""
    programs(nprog)
    case = _case((1, 15, 16, 17, 300, 1000), 8, 2, 128, seed=nprog)
    out = torch.full(case.q.shape, float("nan"), dtype=torch.float32)
    kw = dict(window=window, soft_cap=soft_cap, dot_dtype=torch.float32, programs_per_sm=1)
    run_tma(case, interp, out=out, **kw)
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-4, f"rel err {err:.2e}"  # NaN (a pair never written) fails too


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("v_gain", [1e-3, 1.0, 300.0])
def test_interpreter_fp16_products(interp, lazy, v_gain) -> None:
    """fp16 products (the GPU default): the nibbles centred by the exponent trick, the v scales
    times 2^pv_shift, the epilogue's fp16 un-rotation: accurate for V heads from 1e-3 to 300."""
    case = _case((1, 17, 1000), 8, 2, 64, seed=4, v_gain=v_gain)
    out = torch.empty(case.q.shape, dtype=torch.float32)
    run_tma(case, interp, out=out, num_splits=2, dot_dtype=torch.float16, lazy_rescale=lazy)
    assert torch.isfinite(out).all()
    err = rel_err(out, case.ref())
    assert err < 2e-3, f"rel err {err:.2e}"


@pytest.mark.parametrize(
    "qh,kh,d,page,window,soft_cap,lazy,dot,num_splits",
    [
        (8, 2, 128, 16, None, None, True, torch.float32, 1),
        (12, 4, 64, 16, 100, 5.0, False, torch.float32, 3),
        (16, 4, 64, 32, None, None, True, torch.float16, 2),
        (4, 4, 64, 16, None, None, False, torch.float16, 1),
    ],
    ids=["g4_d128", "g3_swa_cap_eager", "g4_page32_fp16", "g1_fp16_eager"],
)
def test_interpreter_two_kv_heads_per_program(
    interp, qh, kh, d, page, window, soft_cap, lazy, dot, num_splits
) -> None:
    """``kv_heads_per_program=2`` (``int4_pair``): each query head keeps its own kv head's
    logits (the other head's q rows zeroed), scales, zero points and V, across GQA groups of 1,
    3 and 4, windows, soft caps, both rescales and fp16 products."""
    case = _case(LENS, qh, kh, d, page=page, seed=qh + kh)
    out = torch.empty(case.q.shape, dtype=torch.float32)
    kw = dict(window=window, soft_cap=soft_cap, dot_dtype=dot, lazy_rescale=lazy)
    run_tma(case, interp, out=out, num_splits=num_splits, kv_heads_per_program=2, **kw)
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < (5e-4 if dot == torch.float32 else 2e-3), f"rel err {err:.2e}"


def test_interpreter_rejects_bad_kv_heads_per_program(interp) -> None:
    """Two kv heads a program need an int4 cache with an even kv head count, one page per
    iteration and the split grid; other counts than 1 and 2 are refused."""
    odd = _case((5, 40), 6, 3, 64)
    with pytest.raises(ValueError, match=r"kv_heads_per_program=2: .*even kv head count \(got 3\)"):
        run_tma(odd, interp, kv_heads_per_program=2)
    case = _case((5, 40), 8, 2, 64)
    for kw in (dict(kv_heads_per_program=3), dict(kv_heads_per_program=2, pages_per_iter=2),
               dict(kv_heads_per_program=2, programs_per_sm=1)):  # fmt: skip
        with pytest.raises(ValueError, match=r"kv_heads_per_program=\d: 1, or 2 for an"):
            run_tma(case, interp, **kw)
    k8v4 = ScaledCase((5, 40), 8, 2, 64, "k8v4")
    with pytest.raises(ValueError, match=r"got 'k8v4'"):
        run_tma(k8v4, interp, kv_heads_per_program=2)


def test_paired_splits() -> None:
    """Host logic: the two-kv-heads grid takes the most splits at or under 8 programs per SM
    (any count, no power of two) and is the default only where that lands at 7.25 or more, at
    head 128 (``PAIRED``'s only entry)."""
    ps = decode_config.paired_splits
    at = dict(max_seq_len=16384, page=16, sms=132, kind="int4")
    got = {b: ps(b, 8, head_size=128, **at) for b in (16, 24, 32, 40, 48, 64, 80, 96, 128, 197)}
    assert got == {16: (16, True), 24: (11, True), 32: (8, True), 40: (6, True), 48: (5, True),
                   64: (4, True), 80: (3, True), 96: (2, False), 128: (2, True),
                   197: (1, False)}  # fmt: skip
    assert ps(32, 8, head_size=256, **at) == (8, False)  # head 128's numbers, not taken
    assert ps(32, 8, 1000, 16, 128, 132, "int4") == (1, False)  # one split of 64 pages at most
    with pytest.raises(ValueError, match="kv_heads=3 must be even"):
        ps(32, 3, head_size=128, **at)
    with pytest.raises(ValueError, match="cache kind 'k8v4'"):
        ps(32, 8, 16384, 16, 128, 132, "k8v4")
    assert decode_config.tuned(128, "int4", paired=True)["lazy_rescale"] is False


def test_interpreter_default_takes_the_pair_where_paired(interp, monkeypatch) -> None:
    """With no schedule given, ``paged_decode_tma`` runs two kv heads per program exactly where
    ``paired_splits`` takes it (here made to take a small case), with its split count, and one
    head per program where a schedule, two pages per iteration or an odd kv head count is
    given; explicit ``kv_heads_per_program=2`` takes ``paired_splits``'s split count."""
    launches = []

    class Spy:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((grid, kw["NH"]))
                return self.kernel[grid](*args, **kw)

            return launch

    monkeypatch.setattr(interp, "_decode_pages", Spy(interp._decode_pages))
    entries = {**decode_config.PAIRED["int4"], 64: (1, 2, 1, False, None, 0.0, 0.05)}
    monkeypatch.setitem(decode_config.PAIRED, "int4", entries)
    case = _case(LENS, 8, 2, 64, seed=5)
    ref = case.ref()
    out = torch.empty(case.q.shape, dtype=torch.float32)
    run_tma(case, interp, out=out, dot_dtype=torch.float32)
    splits = decode_config.paired_splits(len(LENS), 2, max(LENS), 16, 64, 132, "int4")[0]
    assert launches.pop() == ((1, splits, len(LENS)), 2)
    assert rel_err(out, ref) < 5e-4
    for kw in (dict(num_splits=2), dict(pages_per_iter=2), dict(kv_heads_per_program=1)):
        run_tma(case, interp, out=out, dot_dtype=torch.float32, **kw)
        assert launches.pop()[1] == 1, kw
    run_tma(case, interp, out=out, dot_dtype=torch.float32, kv_heads_per_program=2)
    assert launches.pop() == ((1, splits, len(LENS)), 2)
    odd = _case(LENS, 6, 3, 64, seed=6)
    run_tma(odd, interp, dot_dtype=torch.float32)
    assert launches.pop()[1] == 1


def test_int4_pv_shift_keeps_fp16_in_range() -> None:
    """Host arithmetic, as for the 8-bit codes: with the shift, the largest weight times scale
    (scale up to absmax / 7.5) stays finite in fp16 for rotated |v| up to 1900 (lazy: weights
    <= 2^8) and 30000 (eager: <= 1), not needlessly small, and the smallest scale (absmax / 30)
    of an absmax of 2e-3 (lazy) / 1.2e-4 (eager) is normal in fp16."""
    from torch_kvq.attention.triton.decode_tma import pv_shift

    for lazy, p_max, top, low in ((True, 2.0**8, 1900.0, 2e-3), (False, 1.0, 30000.0, 1.2e-4)):
        s = 2.0 ** pv_shift(torch.uint8, torch.float16, lazy)
        assert p_max * top / 7.5 * s < 65504, lazy
        assert p_max * 4 * top / 7.5 * s > 65504, lazy
        assert low / 30 * s >= 2.0**-14, lazy
    assert pv_shift(torch.uint8, torch.bfloat16, True) == 0
    assert pv_shift(torch.uint8, torch.float32, False) == 0


def test_interpreter_rejects_bad_int4_arguments(interp) -> None:
    case = _case((5, 40), 8, 2, 64)
    with pytest.raises(ValueError, match=r"uint8 \(int4_per_token_head\) cache needs its"):
        run_tma(case, interp, kv_scale=None)
    with pytest.raises(ValueError, match=r"last dim must be head_dim / 2 = 32 .* got 64"):
        wide = torch.zeros((*case.kv_cache.shape[:-1], 64), dtype=torch.uint8)
        interp.paged_decode_tma(case.q, wide, dense_table(case), case.seq_lens, 1.0, 1.0, 1.0,
                                max_seq_len=40, kv_scale=case.kv_scale)  # fmt: skip
    with pytest.raises(ValueError, match=r"head_dim >= 32"):
        q16 = case.q[..., :16].contiguous()
        tiny = case.kv_cache[..., :8].contiguous()
        interp.paged_decode_tma(q16, tiny, dense_table(case), case.seq_lens, 1.0, 1.0, 1.0,
                                max_seq_len=40, kv_scale=case.kv_scale)  # fmt: skip
    with pytest.raises(ValueError, match=r"expected contiguous float32 \(7, 2, 2, 16\)"):
        run_tma(case, interp, kv_scale=case.kv_scale.transpose(2, 3).contiguous())
    # the 4-bit loops read the scales by TMA: their first byte 16-byte aligned
    shifted = torch.empty(case.kv_scale.numel() + 1)[1:].view(case.kv_scale.shape)
    shifted.copy_(case.kv_scale)
    with pytest.raises(ValueError, match=r"kv_scale must start 16-byte aligned .* 4 bytes past"):
        run_tma(case, interp, kv_scale=shifted)


# -- GPU: the compiled kernel ---------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
def test_gpu_unpack_is_exact() -> None:
    """The compiled inline-PTX unpack (fp16) and plain conversions (bf16, fp32)."""
    for dot in (tl.float16, tl.bfloat16, tl.float32):
        lo, hi, want_lo, want_hi = _unpacked("cuda", dot)
        assert torch.equal(lo, want_lo) and torch.equal(hi, want_hi), dot
        _check_centred("cuda", dot)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_long_context_stays_accurate(d: int) -> None:
    """16k tokens of random v: the output is a small average of large values, so any offset
    taken out of the fp32 sums after the products shows (it did: 0.22 relative error)."""
    from torch_kvq.attention.triton import decode_tma

    case = _case((16384, 16384), 32 if d == 128 else 16, 8, d, device="cuda", seed=8)
    for kw in ({}, dict(programs_per_sm=16 if d == 128 else 8, **decode_config.tuned(d, "int4"))):
        out = run_tma(case, decode_tma, **kw)
        err = rel_err(out, case.ref())
        assert err < 5e-3, f"{kw or 'split grid'}: rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qh,kh,d", [(32, 8, 128), (16, 8, 256), (8, 8, 64), (64, 8, 128)])
@pytest.mark.parametrize("num_splits", [1, None])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (64, 5.0)], ids=["global", "swa_cap"])
@pytest.mark.parametrize("ppi", [1, 2])
def test_gpu_split_grid_matches_reference(qh, kh, d, num_splits, window, soft_cap, ppi):
    from torch_kvq.attention.triton import decode_tma

    case = _case((*LENS, 4097), qh, kh, d, device="cuda", seed=ppi)
    kw = dict(window=window, soft_cap=soft_cap, num_splits=num_splits, pages_per_iter=ppi)
    out = run_tma(case, decode_tma, **kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-3, f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qh,kh,d", [(32, 8, 128), (64, 8, 128), (24, 8, 64), (8, 2, 256)])
@pytest.mark.parametrize("num_splits", [1, None])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (64, 5.0)], ids=["global", "swa_cap"])
@pytest.mark.parametrize("lazy", [True, False])
def test_gpu_two_kv_heads_per_program(qh, kh, d, num_splits, window, soft_cap, lazy):
    """The compiled ``int4_pair`` loop (fp16 products, the inline-PTX unpack) at GQA groups 4,
    8 (16 query heads a program) and 3, head sizes 64 to 256."""
    from torch_kvq.attention.triton import decode_tma

    case = _case((*LENS, 4097), qh, kh, d, device="cuda", seed=qh)
    kw = dict(window=window, soft_cap=soft_cap, num_splits=num_splits, lazy_rescale=lazy)
    out = run_tma(case, decode_tma, kv_heads_per_program=2, pages_per_iter=1, **kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-3, f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("page", [32, 64])
@pytest.mark.parametrize("num_splits", [2, None])
def test_gpu_larger_pages(d: int, page: int, num_splits: int | None) -> None:
    from torch_kvq.attention.triton import decode_tma

    case = _case((*LENS, 4097), 16, 8, d, page=page, device="cuda", seed=page)
    out = run_tma(case, decode_tma, num_splits=num_splits)
    assert torch.isfinite(out).all()
    err = rel_err(out, case.ref())
    assert err < 5e-3, f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qh,kh,d,per_sm,regs", [(32, 8, 128, 16, 128), (16, 8, 256, 8, None)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (64, 5.0)], ids=["global", "swa_cap"])
def test_gpu_balanced_matches_reference(qh, kh, d, per_sm, regs, window, soft_cap):
    from torch_kvq.attention.triton import decode_tma

    case = _case((*LENS, 4097), qh, kh, d, device="cuda", seed=3)
    kw = dict(window=window, soft_cap=soft_cap, programs_per_sm=per_sm, max_registers=regs)
    out = run_tma(case, decode_tma, **{**decode_config.tuned(d, "int4"), **kw})  # kw's cap
    assert torch.isfinite(out).all()
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-3, f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("math", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("v_gain", [1e-3, 1.0, 250.0])
def test_gpu_v_magnitudes_stay_accurate(math, d, v_gain) -> None:
    """Small and large V heads at the defaults (lazy at head 128, eager at 256), fp16 and bf16
    products (bf16: the epilogue's un-rotation still rounds to fp16, not bf16)."""
    from torch_kvq.attention.triton import decode_tma

    case = _case((*LENS, 4097), 32 if d == 128 else 16, 8, d, device="cuda", seed=5,
                 v_gain=v_gain)  # fmt: skip
    out = run_tma(case, decode_tma, dot_dtype=math)
    assert torch.isfinite(out).all()
    err = rel_err(out, case.ref())
    assert err < (5e-3 if math == torch.float16 else 1e-2), f"rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("schedule", ["split", "balanced"])
def test_gpu_cuda_graph_replay_follows_new_lengths(schedule: str) -> None:
    """Captured once; replays read seq_lens, the table and the scales from the device."""
    from torch_kvq.attention.triton import decode_balanced, decode_tma

    case = _case((1000, 1000, 1000), 32, 8, 128, device="cuda", seed=6)
    out, table = torch.empty_like(case.q), dense_table(case)
    kw: dict = dict(out=out, **decode_config.tuned(128, "int4"))
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
        # new scales, same buffer: times 2 keeps each zero point (the exponent moves)
        case.kv_scale.mul_(2.0)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, case.ref()) < 5e-3, lens
