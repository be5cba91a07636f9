"""The compact-scratch dequantization (``kernels/kv_dequant.py``): the Triton pass equals the aten
form (``quant.dequantize_pages_per_token_head``) bit for bit, for int8 / e4m3 codes, for int4
ones (unpacked, zero point, un-rotated) and for k8v4 caches (k int8 in slots 0 / 1, v int4 in slot
2), under the interpreter on CPU and on the GPU."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_case import HAS_CUDA, INTERPRETING  # sets the interpreter up first
from torch_kvq.attention import quant, quant_tc
from torch_kvq.attention.kernels.kv_dequant import dequantize_pages, dequantize_pages_triton
from torch_kvq.attention.kernels.kv_dequant_tc import dequantize_pages_tc_triton
from torch_kvq.spec_modes import FP8_DTYPE

DEVICE = "cuda" if HAS_CUDA else "cpu"
on_interpreter = pytest.mark.skipif(
    not INTERPRETING, reason="the interpreter runs where no CUDA is"
)
CASES = [("int4", 2, 16, 128), ("int4", 3, 16, 64), ("int4", 1, 32, 256), ("int8", 8, 16, 128),
         ("fp8", 3, 32, 64), ("int4", 8, 64, 128), ("k8v4", 2, 16, 128), ("k8v4", 3, 32, 64),
         ("k8v4", 1, 16, 256)]  # fmt: skip


def cache_of(fmt: str, pages: int, page: int, kh: int, d: int, seed: int = 0):
    """A cache written from random k/v with outliers (so every code and many zero points occur)."""
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(pages, 2, page, kh, d, generator=g)
        * torch.rand(pages, 2, page, kh, 1, generator=g)
        * 4
    )
    x[..., 3] += 20.0 * (torch.rand(pages, 2, page, kh, generator=g) > 0.9)
    codes, scales = quant.quantize_pages_per_token_head(x.bfloat16(), fmt)
    return codes.to(DEVICE), scales.transpose(-1, -2).contiguous().to(DEVICE)


def _check_equal(fmt: str, kh: int, page: int, d: int, dtype: torch.dtype) -> None:
    cache, scales = cache_of(fmt, 6, page, kh, d)
    code = {"int4": torch.uint8, "k8v4": torch.uint8, "int8": torch.int8, "fp8": FP8_DTYPE}
    assert cache.dtype == code[fmt] and cache.shape[1] == (3 if fmt == "k8v4" else 2)
    ids = torch.tensor([4, 0, 5, 4], dtype=torch.int32, device=DEVICE)
    want = quant.dequantize_pages_per_token_head(cache, scales, ids, dtype)
    got = dequantize_pages_triton(cache, scales, ids, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@on_interpreter
@pytest.mark.parametrize("fmt,kh,page,d", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_interpreter_pass_equals_aten(fmt, kh, page, d, dtype) -> None:
    _check_equal(fmt, kh, page, d, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt,kh,page,d", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_pass_equals_aten(fmt, kh, page, d, dtype) -> None:
    _check_equal(fmt, kh, page, d, dtype)


def _check_empty_batch_and_refusals() -> None:
    cache, scales = cache_of("int4", 2, 16, 2, 64)
    ids = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    assert dequantize_pages_triton(cache, scales, ids, torch.bfloat16).shape == (0, 2, 16, 2, 64)
    with pytest.raises(ValueError, match="power-of-two head size, got head size 96"):
        odd = torch.zeros(2, 2, 16, 2, 48, dtype=torch.uint8, device=DEVICE)
        dequantize_pages_triton(odd, scales, ids, torch.bfloat16)
    with pytest.raises(ValueError, match=r"need \[P, 2, page, KH, D'\] codes \(k8v4: uint8"):
        dequantize_pages_triton(cache, scales[:, :, :1], ids, torch.bfloat16)
    with pytest.raises(ValueError, match=r"kv_cache \(2, 3, 16, 2, 32\)"):  # 3 slots: k8v4's, uint8
        three = torch.zeros(2, 3, 16, 2, 32, dtype=torch.int8, device=DEVICE)
        dequantize_pages_triton(three, scales, ids, torch.bfloat16)


@on_interpreter
def test_interpreter_empty_batch_and_refusals() -> None:
    _check_empty_batch_and_refusals()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_empty_batch_and_refusals() -> None:
    _check_empty_batch_and_refusals()


def test_cpu_cache_takes_the_aten_form() -> None:
    cache, scales = quant.quantize_per_token_head(torch.randn(2, 2, 16, 2, 64), "int4")
    scales = scales.transpose(-1, -2).contiguous()
    ids = torch.tensor([1, 0])
    want = quant.dequantize_pages_per_token_head(cache, scales, ids, torch.bfloat16)
    assert torch.equal(dequantize_pages(cache, scales, ids, torch.bfloat16), want)


TC4_CASES = [(2, 16, 128), (3, 16, 64), (1, 32, 256), (8, 32, 128), (2, 64, 128)]


def _check_tc4(kh: int, page: int, d: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(kh + page + d)
    k = torch.randn(6, page, kh, d, generator=g) * torch.rand(6, page, kh, 1, generator=g) * 4
    v = torch.randn(6, page, kh, d, generator=g)
    v[..., 3] += 20.0 * (torch.rand(6, page, kh, generator=g) > 0.9)
    cache, aux = (x.to(DEVICE) for x in quant_tc.quantize_pages(k, v))
    ids = torch.tensor([4, 0, 5, 4], dtype=torch.int32, device=DEVICE)
    want = quant_tc.dequantize_pages(cache[ids.long()], aux[ids.long()]).to(dtype)
    got = dequantize_pages_tc_triton(cache, aux, ids, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@on_interpreter
@pytest.mark.parametrize("kh,page,d", TC4_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interpreter_tc4_pass_equals_aten(kh, page, d, dtype) -> None:
    """tc4 (``kernels/kv_dequant_tc.py``): k's lanes per group, v's bytes from their ``v_layout``
    positions with half 1's fifth bits, each half un-rotated: the aten scratch, bit for bit."""
    _check_tc4(kh, page, d, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kh,page,d", TC4_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_tc4_pass_equals_aten(kh, page, d, dtype) -> None:
    _check_tc4(kh, page, d, dtype)


def test_tc4_pass_refuses_a_head_size_it_does_not_take() -> None:
    cache = torch.zeros(2, 2, 16, 1, 24, dtype=torch.uint8)
    aux = torch.zeros(2, 1, quant_tc.aux_width(48), 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"head size D in \(64, 128, 256\)"):
        dequantize_pages_tc_triton(cache, aux, torch.zeros(1, dtype=torch.int32), torch.float32)
