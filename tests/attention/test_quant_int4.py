"""The 4-bit per-(token, head) math of ``attention/quant.py`` (issue 33, before its mode): the
Hadamard rotation, the asymmetric and symmetric int4 codes, their packing and the zero point
carried in the scale's low bits."""

from __future__ import annotations

import pytest
import torch

from torch_kvq.attention import quant


@pytest.mark.parametrize("d,block", [(64, 64), (128, 128), (256, 256), (96, 32), (80, 16), (7, 1)])
def test_rotation_is_orthogonal_blockwise_and_undone(d: int, block: int) -> None:
    assert quant.hadamard_block(d) == block
    x = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(d))
    y = quant.rotate(x)
    torch.testing.assert_close(quant.unrotate(y), x, rtol=0, atol=1e-5)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)
    q = torch.randn(5, 3, d)
    torch.testing.assert_close((quant.rotate(q) * y).sum(-1), (q * x).sum(-1), rtol=1e-4, atol=1e-4)
    # blockwise: a vector zero outside one block stays zero outside it
    e = torch.zeros(d)
    e[:block] = torch.randn(block)
    assert quant.rotate(e)[block:].abs().max() == 0 if d > block else True


def test_rotation_spreads_an_outlier_channel() -> None:
    """The reason for the rotation: one large channel becomes D values of equal magnitude."""
    x = torch.zeros(128)
    x[5] = 64.0
    y = quant.rotate(x)
    torch.testing.assert_close(y.abs(), torch.full((128,), 64.0 / 128**0.5))


def test_signs_are_fixed_per_head_size() -> None:
    a, b = quant.hadamard_signs(128), quant.hadamard_signs(128)
    assert torch.equal(a, b) and set(a.tolist()) == {-1.0, 1.0}
    assert not torch.equal(quant.hadamard_signs(64), quant.hadamard_signs(128)[:64])


def test_asymmetric_codes_pack_two_per_byte_with_the_zero_point_in_the_scale() -> None:
    x = torch.tensor([[-1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 14.0]])  # lo -1, hi 14: scale 1, zp 1
    packed, stored = quant.quantize_int4_per_token_head(x)
    scale, zp = quant.split_scale(stored)
    assert scale.item() == 1.0 and zp.item() == 1.0
    assert packed.dtype == torch.uint8 and packed.shape == (1, 4)
    codes = [0, 1, 2, 3, 4, 5, 6, 15]
    assert packed[0].tolist() == [codes[i] | codes[i + 1] << 4 for i in range(0, 8, 2)]
    assert torch.equal(quant.dequantize_int4_per_token_head(packed, stored), x)


@pytest.mark.parametrize("symmetric", [False, True])
def test_dequantized_error_is_within_half_a_step(symmetric: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, 128, generator=g) * torch.rand(64, 8, 1, generator=g) * 10
    packed, stored = quant.quantize_int4_per_token_head(x, symmetric=symmetric)
    scale, zp = quant.split_scale(stored)
    err = (quant.dequantize_int4_per_token_head(packed, stored) - x).abs()
    assert (err <= scale.unsqueeze(-1) * 0.5 * (1 + 1e-5) + 1e-6).all()
    assert (zp == 8).all() if symmetric else ((zp >= 0) & (zp <= 15)).all()


def test_zero_and_constant_heads() -> None:
    """A zero head takes the floor scale and comes back zero; a head of equal values keeps them
    (its range runs from zero: without that it would have none)."""
    x = torch.zeros(3, 16)
    x[1], x[2] = 3.0, -2.0
    packed, stored = quant.quantize_int4_per_token_head(x)
    scale, _ = quant.split_scale(stored)
    assert scale[0] == pytest.approx(1e-6, rel=1e-5)
    torch.testing.assert_close(
        quant.dequantize_int4_per_token_head(packed, stored), x, rtol=1e-5, atol=0
    )


def test_odd_head_size_is_refused() -> None:
    with pytest.raises(ValueError, match="head size must be even, got 7"):
        quant.quantize_int4_per_token_head(torch.randn(2, 7))
