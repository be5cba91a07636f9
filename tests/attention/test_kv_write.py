"""The cache write: the Triton kernel (CUDA) writes exactly the bytes of the aten form.

``write_kv_triton`` against ``write_kv_torch`` (its oracle) and against the unfused eager op path
itself (``kvq.quantize_fp8`` and the torch-native expression, then the plain ``kvq.cache_write``
kernel), bit for bit, over model dtypes, page sizes, head shapes (a non-power-of-two head size
too), strided k / v, every bf16 bit pattern, and scales whose fp32 reciprocal is inexact (0.03,
0.0341: where a multiply by the reciprocal and a true division round to different FP8 values).
On the CPU, ``write_kv`` is the aten form (the rest of the suite covers it); the probe that tells
how aten divides is checked on the CPU too.
"""

from __future__ import annotations

import pytest
import torch

from torch_kvq.attention import ops as _ops  # noqa: F401  (registers torch.ops.kvq.*)
from torch_kvq.attention.kernels import kv_write
from torch_kvq.attention.kernels.kv_write import write_kv, write_kv_torch, write_kv_triton
from torch_kvq.attention.quant import quantize_fp8
from torch_kvq.spec_modes import FP8_DTYPE

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# 0.03 and 0.0341: the scales of the GPU failures of issue 12 (1.5 / 0.03 is an FP8 tie that the
# reciprocal form rounds the other way); 0.02 and 1 / 3: scales where both forms agree.
TIE_SCALES = (0.03, 0.0341, 0.02, 1.0 / 3.0)
QUANT_FORMS = {
    "op": lambda x, s: torch.ops.kvq.quantize_fp8(x, s),
    "torch": quantize_fp8,
}


def test_division_candidates_reproduce_cpu_aten() -> None:
    """The float64 reference of a correctly rounded fp32 division equals aten's CPU division."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1 << 16, generator=g) * 40
    for scale in TIE_SCALES + (13.0, 7.7e-3):
        want = x / scale
        got = kv_write._division_candidates(x, scale)["div"]
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), scale


def test_the_forms_differ_on_a_tie() -> None:
    """1.5 / 0.03 is 50 exactly (an FP8 tie, rounds to 48), and so is 1.5 * float32(1 / 0.03) in
    fp32; 1.5 times the fp32 reciprocal of float32(0.03) is one fp32 step above (52): the bytes
    the GPU suite found differing in issue 12 (aten's CUDA form is "rcp", the kernel used "rcp32")."""
    c = kv_write._division_candidates(torch.tensor([1.5]), 0.03)
    assert c["div"].item() == c["rcp"].item() == 50.0 < c["rcp32"].item()
    assert kv_write.scalar_operand("rcp", 0.03) < kv_write.scalar_operand("rcp32", 0.03)
    fp8 = {form: v.to(FP8_DTYPE).item() for form, v in c.items()}
    assert fp8 == {"div": 48.0, "rcp": 48.0, "rcp32": 52.0}


def test_cpu_probe_finds_true_division() -> None:
    assert kv_write.aten_scalar_division(torch.device("cpu")) == "div"


def _case(dtype, quant, page_size, kh, d, t, pages, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    wide = torch.randn(t, 3 * kh * d, generator=gen, device="cuda") * 40
    wide = wide.to(dtype)
    k = wide[:, : kh * d].view(t, kh, d)  # strided along T, like a view of a fused qkv output
    v = wide[:, 2 * kh * d :].view(t, kh, d)
    cache_dtype = FP8_DTYPE if quant else dtype
    cache = torch.randn(pages, 2, page_size, kh, d, generator=gen, device="cuda").to(cache_dtype)
    slots = torch.randperm(pages * page_size, generator=gen, device="cuda")[:t]
    return cache, k, v, slots


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant", [True, False])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel)")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("kh", "d"), [(8, 128), (1, 64), (3, 96), (2, 256)])
def test_triton_write_equals_aten(dtype, quant, page_size, kh, d) -> None:
    scales = (0.37, 1.0 / 3.0) if quant else None
    cache, k, v, slots = _case(dtype, quant, page_size, kh, d, t=37, pages=64, seed=kh * d)
    want = cache.clone()
    write_kv_torch(want, k, v, slots, scales)
    write_kv_triton(cache, k, v, slots, scales)
    assert torch.equal(_bytes(cache), _bytes(want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.1, 3.0, 7.7e-3, 123.456, *TIE_SCALES])
@pytest.mark.parametrize("form", sorted(QUANT_FORMS))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel)")
def test_fused_quant_write_equals_unfused_op_path(dtype, scale, form) -> None:
    """The fused write equals the eager op path it replaces: the layer's quant (``kvq.quantize_fp8``
    or the torch expression) then the plain (unquantized) write, int32 slots."""
    quant = QUANT_FORMS[form]
    cache, k, v, slots = _case(dtype, True, 16, 8, 128, t=64, pages=16, seed=7)
    want = cache.clone()
    write_kv(want, quant(k, scale), quant(v, 1.5 * scale), slots)
    write_kv(cache, k, v, slots.to(torch.int32), (scale, 1.5 * scale))
    assert torch.equal(_bytes(cache), _bytes(want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel)")
def test_probe_form_is_aten_division() -> None:
    """The form the probe found reproduces aten's CUDA ``x.float() / scale`` on fresh values."""
    device = torch.device("cuda", torch.cuda.current_device())
    form = kv_write.aten_scalar_division(device)
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(5)) * 40
    for scale in TIE_SCALES:
        got = (x.to(device) / scale).cpu()
        want = kv_write._division_candidates(x, scale)[form]
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (form, scale)


@pytest.mark.parametrize("scale", [1.0, 0.0625, 0.3, *TIE_SCALES])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel)")
def test_every_bf16_value_quantizes_like_aten(scale) -> None:
    """All 65536 bf16 bit patterns (zeros, subnormals, the rounding ties, ±inf; NaNs only need
    to stay NaN) as one [64, 8, 128] batch."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16)
    k = bits.view(torch.bfloat16).view(64, 8, 128)
    v = k.flip(0)
    cache = torch.zeros(4, 2, 16, 8, 128, dtype=FP8_DTYPE, device="cuda")
    want = cache.clone()
    slots = torch.arange(64, device="cuda")
    write_kv_torch(want, k, v, slots, (scale, scale))
    write_kv_triton(cache, k, v, slots, (scale, scale))
    got, ref = cache.float(), want.float()
    both_nan = got.isnan() & ref.isnan()
    assert both_nan.sum() > 0  # the NaN patterns are in there
    same = torch.where(both_nan, True, _bytes(cache) == _bytes(want))
    assert bool(same.all()), f"{int((~same).sum())} bytes differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel)")
def test_empty_batch_writes_nothing() -> None:
    cache, k, v, slots = _case(torch.bfloat16, True, 16, 8, 128, t=4, pages=2, seed=0)
    before = cache.clone()
    write_kv_triton(cache, k[:0], v[:0], slots[:0], (1.0, 1.0))
    assert torch.equal(_bytes(cache), _bytes(before))


# -- tensor scales (kvq::quant_cache_write_ts): a 0-d / 1-element float32 buffer as the scale ----


def test_cpu_tensor_scale_write_is_the_unfused_expression() -> None:
    """On the CPU the tensor-scale write is ``(x.float() / scale_tensor)`` itself, bit for bit."""
    g = torch.Generator().manual_seed(2)
    k = (torch.randn(9, 2, 32, generator=g) * 40).to(torch.bfloat16)
    v = (torch.randn(9, 2, 32, generator=g) * 40).to(torch.bfloat16)
    cache = torch.zeros(2, 2, 16, 2, 32, dtype=FP8_DTYPE)
    want = cache.clone()
    slots = torch.arange(3, 12)
    ks, vs = torch.tensor(0.03), torch.tensor([0.0341])
    write_kv(want, quantize_fp8(k, ks), quantize_fp8(v, vs), slots)
    write_kv(cache, k, v, slots, (ks, vs))
    assert torch.equal(_bytes(cache), _bytes(want))


def test_cpu_probe_tensor_scale_is_true_division() -> None:
    assert kv_write.aten_scalar_division(torch.device("cpu"), "tensor") == "div"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.1, 3.0, 7.7e-3, 123.456, *TIE_SCALES])
@pytest.mark.parametrize(("where", "shape"), [("cuda", ()), ("cuda", (1,)), ("cpu", ())])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel)")
def test_fused_tensor_scale_write_equals_unfused(dtype, scale, where, shape) -> None:
    """Scales as float32 tensors on the GPU (loaded by the kernel) or on the CPU (aten treats a
    0-d CPU tensor like a Python scalar): the bytes of the unfused ``x.float() / scale_tensor``."""
    cache, k, v, slots = _case(dtype, True, 16, 8, 128, t=64, pages=16, seed=11)
    ks = torch.full(shape, scale, dtype=torch.float32, device=where)
    vs = torch.full(shape, 1.5 * scale, dtype=torch.float32, device=where)
    want = cache.clone()
    write_kv(want, quantize_fp8(k, ks), quantize_fp8(v, vs), slots)
    write_kv(cache, k, v, slots.to(torch.int32), (ks, vs))
    assert torch.equal(_bytes(cache), _bytes(want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel)")
def test_one_element_cpu_scale_is_refused_like_aten() -> None:
    """aten takes only a 0-d CPU tensor as a scalar: a [1] one fails in the unfused form, and the
    fused write refuses it too."""
    cache, k, v, slots = _case(torch.bfloat16, True, 16, 8, 128, t=8, pages=4, seed=1)
    ks = vs = torch.tensor([0.1])
    with pytest.raises(RuntimeError):
        quantize_fp8(k, ks)
    with pytest.raises(ValueError, match="both 0-d on the CPU"):
        write_kv(cache, k, v, slots, (ks, vs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel)")
def test_tensor_scale_write_follows_the_buffer_and_captures() -> None:
    """The kernel reads the scale tensor when it runs: a CUDA graph captured once replays with the
    buffer's current value (no host sync, no baked constant)."""
    cache, k, v, slots = _case(torch.bfloat16, True, 16, 8, 128, t=32, pages=8, seed=4)
    ks = torch.tensor(0.03, device="cuda")
    vs = torch.tensor(0.0341, device="cuda")
    write_kv(cache.clone(), k, v, slots, (ks, vs))  # warm-up: the probe runs outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv(cache, k, v, slots, (ks, vs))
    for s in (0.02, 0.3):
        ks.fill_(s)
        vs.fill_(2 * s)
        graph.replay()
        want = cache.clone()  # the unfused form with the same (device tensor) scales
        write_kv_torch(want, quantize_fp8(k, ks), quantize_fp8(v, vs), slots)
        assert torch.equal(_bytes(cache), _bytes(want)), s
