"""The cache write: the Triton kernel (CUDA) writes exactly the bytes of the aten form.

``write_kv_triton`` against ``write_kv_torch`` (its oracle) and against the unfused eager form
(``kvq.quantize_fp8`` then the plain write), bit for bit, over model dtypes, page sizes, head
shapes (a non-power-of-two head size too), strided k / v, and every bf16 bit pattern. On the CPU,
``write_kv`` is the aten form (the rest of the suite covers it); these run on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from torch_kvq.attention.kernels.base import quantize_fp8
from torch_kvq.attention.kernels.kv_write import write_kv, write_kv_torch, write_kv_triton
from torch_kvq.spec import FP8_DTYPE

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernel)")
pytestmark = [pytest.mark.gpu, gpu]
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
@pytest.mark.parametrize("scale", [1.0, 0.1, 3.0, 7.7e-3, 123.456])
def test_fused_quant_write_equals_unfused_form(dtype, scale) -> None:
    """The fused op's write equals eager ``kvq.quantize_fp8`` then the plain write, int32 slots."""
    cache, k, v, slots = _case(dtype, True, 16, 8, 128, t=64, pages=16, seed=7)
    want = cache.clone()
    write_kv_torch(want, quantize_fp8(k, scale), quantize_fp8(v, 2 * scale), slots)
    write_kv(cache, k, v, slots.to(torch.int32), (scale, 2 * scale))
    assert torch.equal(_bytes(cache), _bytes(want))


@pytest.mark.parametrize("scale", [1.0, 0.0625, 0.3])
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


def test_empty_batch_writes_nothing() -> None:
    cache, k, v, slots = _case(torch.bfloat16, True, 16, 8, 128, t=4, pages=2, seed=0)
    before = cache.clone()
    write_kv_triton(cache, k[:0], v[:0], slots[:0], (1.0, 1.0))
    assert torch.equal(_bytes(cache), _bytes(before))
