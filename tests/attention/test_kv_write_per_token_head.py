"""The per-(token, head) quant math (``attention/quant.py``) and its cache write
(``kernels/kv_write_per_token_head.write_kv_per_token_head``, the Triton program on CUDA).

CPU: the math against its definition (exact rounding, the scale floor, fp8 and int8 codes), the
dequantized pages, the aten write and its argument checks; with Triton installed, the Triton
program under the interpreter against the aten write, bit for bit, with aten's CPU division and
with the reciprocal form aten uses on CUDA. GPU: the program against the unfused torch ops on the
device (the op form and the torch-native expression a model writes), bit for bit.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from torch_kvq.attention import quant
from torch_kvq.attention.kernels import kv_write, kv_write_per_token_head
from torch_kvq.attention.kernels.kv_write_per_token_head import (
    write_kv_per_token_head,
    write_kv_per_token_head_torch,
)
from torch_kvq.spec_modes import FP8_DTYPE

HAS_CUDA = torch.cuda.is_available()
MODES = ("int8", "fp8")
CODE = {"int8": torch.int8, "fp8": FP8_DTYPE}


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == FP8_DTYPE else x.view(torch.int8)


# -- the math -------------------------------------------------------------------------------------


def test_round_half_away_is_exact_at_ties_and_beside_them() -> None:
    below_half = torch.tensor(0.5).nextafter(torch.tensor(0.0))  # 0.49999997
    y = torch.tensor([0.5, -0.5, 1.5, -2.5, 126.5, -127.5, 3.0, -0.0, 0.0])
    y = torch.cat([y, below_half.view(1), -below_half.view(1), torch.tensor([2.5]).nextafter(
        torch.tensor([0.0]))])  # fmt: skip
    got = quant.round_half_away(y)
    want = [1.0, -1.0, 2.0, -3.0, 127.0, -128.0, 3.0, 0.0, 0.0, 0.0, 0.0, 2.0]
    assert got.tolist() == want
    assert (below_half + 0.5).floor().item() == 1.0  # why floor(|y| + 0.5) is not used


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once, as the GPU's fma: the product is exact in float64; the sum's
    float64 rounding error (TwoSum) settles the fp32 midpoints it could move."""
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    bb = s - p
    lo = (p - (s - bb)) + (c64 - bb)
    f = s.float()
    g = f.double()
    nb = torch.nextafter(f, torch.where(s > g, torch.inf, -torch.inf))
    tie = (g != s) & (s == (g + nb.double()) / 2) & (lo != 0)
    return torch.where(tie & ((lo > 0) == (nb.double() > g)), nb, f)


def _int8_bits(y: torch.Tensor, half_away: bool = True) -> torch.Tensor:
    """The compiled int8 rounding (``triton/kv_write._int8_codes``) step by step: half away,
    ``a = |y| + 0.49999997`` (fp32), ``b = a + 2^23`` rounded toward zero (= 2^23 + floor(a)),
    the low byte of ``(bits(b) ^ m) - m``, m all ones where y is negative; half even, the low
    byte of ``y + 1.5 * 2^23`` rounded to nearest even."""
    if not half_away:
        return (y + 12582912.0).view(torch.int32).to(torch.int8)
    a = y.abs() + 0.49999997
    b = (torch.floor(a.double()) + 2.0**23).float()  # exact: an integer below 2^24
    m = y.view(torch.int32) >> 31
    return ((b.view(torch.int32) ^ m) - m).to(torch.int8)


def test_the_compiled_division_is_aten_division_in_codes() -> None:
    """The Triton write's compiled ``x / s`` (``triton/kv_write._divide_rows``: ``r = 1 / s``,
    ``y0 = x * r``, ``n = fma(y0, s, -x)``, ``fma(n, -r, y0)``), emulated exactly here, gives the
    bytes of the correctly rounded division, -0's sign included, for every finite bf16 x with
    |x| <= absmax, at scales of both modes in both of aten's forms (``absmax / QMAX``,
    ``absmax * (1 / QMAX)``), and the compiled int8 rounding (``_int8_bits``) its codes, both
    roundings; the quotients themselves differ only where fp32 underflows (|x| < 2^-100: the
    residual; or a subnormal quotient), and there every code is zero (the scale is at least
    1e-6)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    xs = bits.view(torch.bfloat16).float()
    xs = xs[torch.isfinite(xs)]
    g = torch.Generator().manual_seed(0)
    amaxes = torch.cat([xs.abs()[torch.randint(len(xs), (24,), generator=g)],
                        torch.tensor([1e-30, 1.27e-4, 1.0, 448.0, 3e38])])  # fmt: skip
    for amax in amaxes.tolist():
        x = xs[xs.abs() <= amax]
        for mode in MODES:
            _, qmax = quant.per_token_head_format(mode)
            for s in (
                torch.tensor(amax) / qmax,
                torch.tensor(amax) * kv_write.scalar_operand("rcp", qmax),
            ):
                s = s.clamp(min=quant.SCALE_FLOOR).expand_as(x)
                r = (1.0 / s.double()).float()  # div_rn(1, s): correctly rounded
                y0 = x * r
                y = _fma32(_fma32(y0, s, -x), -r, y0)
                want = x / s
                # the residual x - y0 * s (~ x * 2^-24) and the quotient are normal fp32 values
                normal = (x.abs() > 2.0**-100) & (want.abs() >= 2.0**-126)
                assert torch.equal(y[normal].view(torch.int32), want[normal].view(torch.int32))
                if mode == "int8":
                    for away in (True, False):
                        rounded = quant.round_half_away(want) if away else want.round()
                        codes = rounded.clamp(-128, 127).to(torch.int8)
                        assert torch.equal(_int8_bits(y, away), codes), (amax, away)
                else:  # the compiled cast saturates: aten's clamp to +-448, the same bytes
                    got = y.clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8)
                    assert torch.equal(got, want.clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8))


def test_half_away_by_floor_is_exact() -> None:
    """The compiled int8 rounding (``_int8_bits``: ``floor(|y| + 0.49999997)`` by an add toward
    zero, y's sign on the integer) is ``round_half_away`` at ties, beside them, at 0.49999997
    (where ``|y| + 0.5`` fails) and at +-0; half even is ``torch.round``."""
    y = torch.cat([torch.arange(-127, 127.5, 0.5), torch.rand(100_000) * 254 - 127,
                   torch.tensor([0.49999997, -0.49999997, 0.5, 1.4999999, 2.5000002, 126.5,
                                 -0.0, 0.0])])  # fmt: skip
    y = torch.cat([y, torch.nextafter(y, y + 1), torch.nextafter(y, y - 1)]).clamp(-127.4, 127.4)
    assert torch.equal(_int8_bits(y), quant.round_half_away(y).to(torch.int8))
    assert torch.equal(_int8_bits(y, half_away=False), y.round().to(torch.int8))
    assert (torch.tensor(0.49999997) + 0.5).floor().item() == 1.0  # why not |y| + 0.5


@pytest.mark.parametrize("mode", MODES)
def test_quantize_follows_the_definition(mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 4, 64, generator=g) * 3).to(torch.bfloat16)
    x[0, 1] = 0  # an all-zero head: the floor, codes 0
    x[1, 2] = 1e-9  # a tiny one: the floor
    codes, scales = quant.quantize_per_token_head(x, mode)
    code_dtype, qmax = quant.per_token_head_format(mode)
    assert codes.dtype == code_dtype and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (33, 4)
    amax = x.float().abs().amax(-1)
    assert torch.equal(scales, torch.maximum(amax / qmax, torch.tensor(1e-6)))
    assert scales[0, 1] == scales[1, 2] == torch.tensor(1e-6) and not codes[0, 1].float().any()
    y = x.float() / scales[..., None]
    if mode == "int8":
        assert torch.equal(codes.float(), quant.round_half_away(y).clamp(-128, 127))
        assert int(codes.abs().max()) == 127  # every head's absmax maps to 127
    else:
        assert torch.equal(_bytes(codes), _bytes(y.clamp(-448, 448).to(FP8_DTYPE)))
    back = quant.dequantize_per_token_head(codes, scales)
    err = (back - x.float()).abs() / scales[..., None]  # in units of each head's scale
    bound = 0.5 if mode == "int8" else 16.0  # half a step: of 1, of e4m3's 32 at the top
    assert float(err.max()) <= bound * (1 + 1e-5)  # fp32 roundings of the product and quotient


def test_half_even_is_torch_round_and_differs_from_half_away() -> None:
    x = torch.tensor([[[127.0, 0.5, 1.5, 2.5, -2.5, 3.5]]])  # scale 1: y = x
    away, _ = quant.quantize_per_token_head(x, "int8")
    even, _ = quant.quantize_per_token_head(x, "int8", rounding="half_even")
    assert away.tolist() == [[[127, 1, 2, 3, -3, 4]]]
    assert even.tolist() == [[[127, 0, 2, 2, -2, 4]]]
    native = (x / (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-6)).round()
    assert torch.equal(even, native.clamp(-128, 127).to(torch.int8))


def test_bad_mode_and_rounding_are_named() -> None:
    x = torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match=r"unknown per-\(token, head\) format 'int2'; expected"):
        quant.quantize_per_token_head(x, "int2")
    with pytest.raises(ValueError, match=r"unknown rounding 'up'; expected one of \['half_away', "):
        quant.quantize_per_token_head(x, "int8", rounding="up")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", MODES)
def test_dequantized_pages_are_compact_and_in_page_order(mode: str) -> None:
    cache, scale, _ = _cache(mode, pages=6, page=4, kh=2, d=8)
    ids = torch.tensor([4, 1, 5], dtype=torch.int32)
    out = quant.dequantize_pages_per_token_head(cache, scale, ids, torch.bfloat16)
    assert out.shape == (3, 2, 4, 2, 8) and out.dtype == torch.bfloat16
    for i, p in enumerate(ids.tolist()):
        for kv in (0, 1):
            want = cache[p, kv].float() * scale[p, kv].T[..., None]  # [page, KH, D]
            assert torch.equal(out[i, kv], want.to(torch.bfloat16))
    f32 = quant.dequantize_pages_per_token_head(cache, scale, ids, torch.float32)
    assert torch.equal(f32.to(torch.bfloat16), out)  # rounded once, from the fp32 value


# -- the aten write ----------------------------------------------------------------------------


def _cache(mode: str, pages: int, page: int, kh: int, d: int, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = (torch.randn(pages, 2, page, kh, d, generator=g) * 20).to(CODE[mode]).to(device)
    scale = (torch.rand(pages, 2, kh, page, generator=g) + 0.5).to(device)
    return cache, scale, g


def _kv(t: int, kh: int, d: int, dtype: torch.dtype, g: torch.Generator, device: str = "cpu"):
    """k and v [T, KH, D] as views of one fused projection output (strided along T)."""
    wide = (torch.randn(t, 3 * kh * d, generator=g) * 4).to(dtype).to(device)
    return wide[:, : kh * d].view(t, kh, d), wide[:, 2 * kh * d :].view(t, kh, d)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rounding", ["half_away", "half_even"])
def test_cpu_write_is_quantize_then_scatter(mode: str, rounding: str) -> None:
    cache, scale, g = _cache(mode, pages=5, page=4, kh=3, d=16)
    k, v = _kv(9, 3, 16, torch.bfloat16, g)
    slots = torch.randperm(20, generator=g)[:9]
    before_c, before_s = cache.clone(), scale.clone()
    write_kv_per_token_head(cache, scale, k, v, slots, mode, rounding)
    kc, ks = quant.quantize_per_token_head(k, mode, rounding)
    vc, vs = quant.quantize_per_token_head(v, mode, rounding)
    for i, slot in enumerate(slots.tolist()):
        p, o = divmod(slot, 4)
        assert torch.equal(_bytes(cache[p, 0, o]), _bytes(kc[i]))
        assert torch.equal(_bytes(cache[p, 1, o]), _bytes(vc[i]))
        assert torch.equal(scale[p, 0, :, o], ks[i]) and torch.equal(scale[p, 1, :, o], vs[i])
    untouched = torch.ones(5 * 4, dtype=torch.bool)
    untouched[slots] = False
    keep = untouched.view(5, 4)
    assert torch.equal(_bytes(cache)[keep[:, None].expand(5, 2, 4)], _bytes(before_c)[
        keep[:, None].expand(5, 2, 4)])  # fmt: skip
    assert torch.equal(scale.transpose(2, 3)[keep[:, None].expand(5, 2, 4)],
                       before_s.transpose(2, 3)[keep[:, None].expand(5, 2, 4)])  # fmt: skip


def test_write_argument_checks_name_the_bad_argument() -> None:
    cache, scale, g = _cache("int8", pages=2, page=4, kh=2, d=8)
    k, v = _kv(3, 2, 8, torch.bfloat16, g)
    slots = torch.arange(3)
    cases = [
        ((cache.to(FP8_DTYPE), scale, k, v, slots, "int8"), r"kv_cache is torch.float8_e4m3fn"),
        ((cache, scale.double(), k, v, slots, "int8"), r"kv_scale is torch.float64"),
        ((cache, scale.transpose(2, 3), k, v, slots, "int8"), r"expected float32 \(2, 2, 2, 4\)"),
        ((cache, scale, k[:, :1], v, slots, "int8"), r"k is torch.bfloat16 \(3, 1, 8\)"),
        ((cache, scale, k, v.int(), slots, "int8"), r"v is torch.int32"),
        ((cache, scale, k, v, slots[:2], "int8"), r"slot_mapping torch.int64 \(2,\) must agree"),
        ((cache, scale, k, v, slots, "int2"), r"unknown per-\(token, head\) format 'int2'"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            write_kv_per_token_head(*args)


# -- the Triton program under the interpreter (CPU, needs Triton) ---------------------------------

if importlib.util.find_spec("triton") is not None and not HAS_CUDA:
    # as tests/attention/triton_case.py: the interpreter flag goes in before Triton is imported
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETING or importlib.util.find_spec("triton") is None,
    reason="needs Triton's interpreter (Triton installed, no CUDA); the GPU tests run the program",
)


def _interpret(cache, scale, k, v, slots, mode, rounding, monkeypatch=None, division="div"):
    if monkeypatch is not None:  # pretend aten divides as on CUDA (a reciprocal multiply)
        real = kv_write.aten_scalar_division
        monkeypatch.setattr(
            kv_write_per_token_head, "aten_scalar_division", lambda dev, kind="float": division
            if kind == "float" else real(dev, kind),
        )  # fmt: skip
    kv_write_per_token_head.write_kv_per_token_head_triton(
        cache, scale, k, v, slots, mode, rounding
    )


@needs_interpreter
@pytest.mark.parametrize("mode,rounding", [("int8", "half_away"), ("int8", "half_even"),
                                           ("fp8", "half_away")])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kh,d,page", [(2, 64, 16), (3, 96, 1), (1, 256, 4)])
def test_interpreter_program_equals_aten(mode, rounding, dtype, kh, d, page) -> None:
    cache, scale, g = _cache(mode, pages=8, page=page, kh=kh, d=d, seed=kh * d)
    k, v = _kv(7, kh, d, dtype, g)
    k[0, 0] = 0  # the floor
    ties = (torch.arange(d) % 128).float() - 63.5  # scale 127 / 127 = 1: every code a tie
    ties[0] = 127.0
    v[1, -1] = ties.to(dtype)
    slots = torch.randperm(8 * page, generator=g)[:7].to(torch.int32)
    want_c, want_s = cache.clone(), scale.clone()
    write_kv_per_token_head_torch(want_c, want_s, k, v, slots.long(), mode, rounding)
    _interpret(cache, scale, k, v, slots, mode, rounding)
    assert torch.equal(scale, want_s)
    if mode == "fp8":  # the interpreter's own e4m3 cast of aten's quotients (see _interpreter_e4m3)
        p, o = slots.long() // page, slots.long() % page
        for x, kv in ((k, 0), (v, 1)):
            y = (x.float() / want_s[p, kv, :, o][..., None]).clamp(-448, 448)
            want_c[p, kv, o] = _interpreter_e4m3(y)
    assert torch.equal(_bytes(cache), _bytes(want_c))


def _interpreter_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 as Triton's interpreter casts (round to nearest even, except that it loses the
    carry into the next binade: 127.99 -> 64, not 128; Triton 3.9). The compiled cast is checked
    against torch's on the GPU (here and in test_kv_write.py)."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + o, mask=o < n)
        tl.store(y_ptr + o, x.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=o < n)

    flat = y.contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=FP8_DTYPE)
    cast[(1,)](flat, out, flat.numel(), BLOCK=triton.next_power_of_2(max(flat.numel(), 1)))
    return out.view(y.shape)


@needs_interpreter
@pytest.mark.parametrize("mode", MODES)
def test_interpreter_reciprocal_form_matches_aten_on_cuda(monkeypatch, mode: str) -> None:
    """aten on CUDA computes ``absmax / QMAX`` as ``absmax * float32(1 / QMAX)`` ("rcp"): the
    program then multiplies, and its scales are that product (floored), codes from them."""
    cache, scale, g = _cache(mode, pages=4, page=16, kh=4, d=128, seed=3)
    k, v = _kv(40, 4, 128, torch.bfloat16, g)
    slots = torch.randperm(64, generator=g)[:40]
    _interpret(cache, scale, k, v, slots, mode, "half_away", monkeypatch, "rcp")
    _, qmax = quant.per_token_head_format(mode)
    rcp = kv_write.scalar_operand("rcp", qmax)
    for x, kv in ((k, 0), (v, 1)):
        want = torch.maximum(x.float().abs().amax(-1) * rcp, torch.tensor(1e-6))
        p, o = slots // 16, slots % 16
        assert torch.equal(scale[p, kv, :, o], want)
        y = x.float() / want[..., None]
        if mode == "int8":
            codes = quant.round_half_away(y).clamp(-128, 127)
        else:
            codes = _interpreter_e4m3(y.clamp(-448, 448)).float()
        assert torch.equal(cache[p, kv, o].float(), codes)
    div = (k.float().abs().amax(-1) / qmax).clamp(min=1e-6)
    assert not torch.equal(div, torch.maximum(k.float().abs().amax(-1) * rcp, torch.tensor(1e-6)))


@needs_interpreter
def test_interpreter_empty_batch_writes_nothing() -> None:
    cache, scale, g = _cache("int8", pages=2, page=16, kh=2, d=64)
    k, v = _kv(0, 2, 64, torch.bfloat16, g)
    before = cache.clone(), scale.clone()
    _interpret(cache, scale, k, v, torch.zeros(0, dtype=torch.int64), "int8", "half_away")
    assert torch.equal(cache, before[0]) and torch.equal(scale, before[1])


# -- GPU: the compiled program against the unfused torch ops on the device ------------------------

needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (Triton program)")


def _native(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch-native expression a model writes (int literal divisor, ``.round()``)."""
    amax = x.float().abs().amax(-1, keepdim=True)
    if mode == "int8":
        s = (amax / 127).clamp(min=1e-6)
        return (x.float() / s).round().clamp(-128, 127).to(torch.int8), s.squeeze(-1)
    s = (amax / 448).clamp(min=1e-6)
    return (x.float() / s).clamp(-448, 448).to(FP8_DTYPE), s.squeeze(-1)


def _scatter(cache, scale, slots, kc, ks, vc, vs) -> None:
    page = cache.shape[2]
    p, o = slots // page, slots % page
    cache[p, 0, o], cache[p, 1, o] = kc, vc
    scale[p, 0, :, o], scale[p, 1, :, o] = ks, vs


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kh,d,page", [(8, 128, 16), (8, 256, 16), (1, 64, 1), (3, 96, 32)])
def test_gpu_write_equals_unfused_ops(mode, dtype, kh, d, page) -> None:
    pages = max(64, 600 // page)  # room for the 300 tokens at every page size
    cache, scale, g = _cache(mode, pages=pages, page=page, kh=kh, d=d, device="cuda", seed=d)
    k, v = _kv(300, kh, d, dtype, g, device="cuda")
    slots = torch.randperm(pages * page, device="cuda")[:300]
    want_c, want_s = cache.clone(), scale.clone()
    kc, ks = quant.quantize_per_token_head(k, mode)
    vc, vs = quant.quantize_per_token_head(v, mode)
    _scatter(want_c, want_s, slots, kc, ks, vc, vs)
    write_kv_per_token_head(cache, scale, k, v, slots.to(torch.int32), mode)
    assert torch.equal(_bytes(cache), _bytes(want_c)) and torch.equal(scale, want_s)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_write_equals_the_torch_native_form(mode: str) -> None:
    """``rounding="half_even"``: the bytes of the expression a model writes (``amax / 127`` with
    an int literal, ``.round()``), on values full of rounding ties."""
    cache, scale, g = _cache(mode, pages=32, page=16, kh=8, d=128, device="cuda", seed=5)
    k, v = _kv(256, 8, 128, torch.bfloat16, g, device="cuda")
    k[::3] = (k[::3].float() * 2).round().to(torch.bfloat16) / 2  # many x / s on .5
    slots = torch.randperm(512, device="cuda")[:256]
    want_c, want_s = cache.clone(), scale.clone()
    (kc, ks), (vc, vs) = _native(k, mode), _native(v, mode)
    _scatter(want_c, want_s, slots, kc, ks, vc, vs)
    write_kv_per_token_head(cache, scale, k, v, slots, mode, "half_even")
    assert torch.equal(_bytes(cache), _bytes(want_c)) and torch.equal(scale, want_s)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_every_bf16_value_quantizes_like_aten(mode: str) -> None:
    """All 65536 bf16 bit patterns but NaN, as 512 heads of 128 (zeros, subnormals, huge and tiny
    heads, +-inf excluded: they make the scale inf)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16)
    x = bits.view(torch.bfloat16).float()
    keep = torch.isfinite(x)
    x = torch.where(keep, x, 0.0).to(torch.bfloat16).view(64, 8, 128)
    cache = torch.zeros(4, 2, 16, 8, 128, dtype=CODE[mode], device="cuda")
    scale = torch.zeros(4, 2, 8, 16, device="cuda")
    slots = torch.arange(64, device="cuda")
    want_c, want_s = cache.clone(), scale.clone()
    kc, ks = quant.quantize_per_token_head(x, mode)
    vc, vs = quant.quantize_per_token_head(x.flip(0), mode)
    _scatter(want_c, want_s, slots, kc, ks, vc, vs)
    write_kv_per_token_head(cache, scale, x, x.flip(0), slots, mode)
    assert torch.equal(_bytes(cache), _bytes(want_c)) and torch.equal(scale, want_s)


@pytest.mark.gpu
@needs_gpu
def test_gpu_write_captures_in_a_cuda_graph() -> None:
    cache, scale, g = _cache("int8", pages=8, page=16, kh=8, d=128, device="cuda", seed=9)
    k, v = _kv(32, 8, 128, torch.bfloat16, g, device="cuda")
    slots = torch.arange(32, device="cuda")
    write_kv_per_token_head(cache.clone(), scale.clone(), k, v, slots, "int8")  # probes, compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv_per_token_head(cache, scale, k, v, slots, "int8")
    k.mul_(3)
    slots.add_(40)
    graph.replay()
    want_c, want_s = cache.clone(), scale.clone()
    write_kv_per_token_head_torch(want_c, want_s, k, v, slots, "int8")
    assert torch.equal(cache, want_c) and torch.equal(scale, want_s)
