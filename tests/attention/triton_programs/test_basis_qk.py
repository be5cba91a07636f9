"""The K-basis products' Triton program (``kernels/basis_qk.py``, one launch for P k and P^-T q)
against ``k_basis.basis_qk``'s einsums: the same values but in near-ties (fp32 sums in another
order) for 16-bit pairs and fp32 matrices, at every head size the modes take, with q and k as
strided views of one fused projection; under the interpreter on CPU and compiled on the GPU
(where ``kvq.basis_qk`` runs it)."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_case import HAS_CUDA, INTERPRETING  # sets the interpreter up first
from torch_kvq.attention.k_basis import basis_operand, basis_qk, inverse_transpose
from torch_kvq.attention.kernels.basis_qk import apply_basis, apply_basis_triton

DEVICE = "cuda" if HAS_CUDA else "cpu"
on_interpreter = pytest.mark.skipif(
    not INTERPRETING, reason="the interpreter runs where no CUDA is"
)
# (tokens, kv heads, query heads per kv head, head size): a decode batch, a prompt's rows over
# several row blocks, head sizes 64 / 128 / 256 and one that is a multiple of 16 only
CASES = [(5, 2, 4, 128), (3, 1, 8, 64), (2, 2, 2, 256), (70, 2, 2, 32), (33, 1, 1, 80)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _case(t: int, kh: int, g: int, d: int, dtype: torch.dtype, seed: int = 0):
    """q and k as views of one [T, (H + 2 KH) D] projection (strided rows), P not orthogonal,
    and both matrices as ``basis_operand`` makes them for ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.linalg.qr(torch.randn(kh, d, d, generator=gen))[0]
    p = p * (torch.rand(kh, 1, d, generator=gen) * 3 + 0.2)
    h = kh * g
    qkv = (torch.randn(t, (h + 2 * kh) * d, generator=gen) * 3).to(dtype).to(DEVICE)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + kh) * d].view(t, kh, d)
    mats = [basis_operand(m, dtype).to(DEVICE) for m in (p, inverse_transpose(p))]
    return q, k, mats


def _check(t: int, kh: int, g: int, d: int, dtype: torch.dtype) -> None:
    q, k, mats = _case(t, kh, g, d, dtype)
    assert not q.is_contiguous()
    want = basis_qk(q, k, *mats)
    got = apply_basis_triton(q, k, *mats)
    for x, ref in zip(got, want, strict=True):
        assert x.dtype == dtype and x.shape == ref.shape and x.is_contiguous()
        if dtype == torch.float32:  # fp32 out: sums in another order, a few ulps
            torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)
            continue
        differ = x != ref  # near-ties: a last-bit difference where the order moved the sum
        assert differ.float().mean() < 0.01
        ulp = ref.float().abs() * (2.0 ** -(7 if dtype == torch.bfloat16 else 10))
        assert ((x.float() - ref.float()).abs() <= ulp + 1e-30)[differ].all()


@on_interpreter
@pytest.mark.parametrize("t,kh,g,d", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_interpreter_program_equals_the_einsums(t, kh, g, d, dtype) -> None:
    _check(t, kh, g, d, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("t,kh,g,d", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_program_equals_the_einsums(t, kh, g, d, dtype) -> None:
    _check(t, kh, g, d, dtype)


def test_no_tokens_and_bad_shapes() -> None:
    """An empty batch gives empty outputs; a head size off 16, or q and k of other shapes, are
    refused with what was expected."""
    q, k, mats = _case(1, 2, 2, 64, torch.bfloat16)
    qo, ko = apply_basis_triton(q[:0], k[:0], *mats)
    assert qo.shape == (0, 4, 64) and ko.shape == (0, 2, 64)
    with pytest.raises(ValueError, match=r"need q \[T, H, D\]"):
        apply_basis(q[:, :3], k, *mats)
    q, k, mats = _case(1, 1, 1, 40, torch.bfloat16)
    with pytest.raises(ValueError, match="head size 40"):
        apply_basis_triton(q, k, *mats)
