"""The 4-bit per-(token, head) math of ``attention/quant.py`` (issue 33, before its mode): the
Hadamard rotation, the asymmetric and symmetric int4 codes, their packing and the zero point
carried in the scale's low bits."""

from __future__ import annotations

import pytest
import torch

from torch_kvq.attention import quant, rotation


@pytest.mark.parametrize("d,block", [(64, 64), (128, 128), (256, 256), (96, 32), (80, 16), (7, 1)])
def test_rotation_is_orthogonal_blockwise_and_undone(d: int, block: int) -> None:
    assert rotation.hadamard_block(d) == block
    x = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(d))
    y = rotation.rotate(x)
    torch.testing.assert_close(rotation.unrotate(y), x, rtol=0, atol=1e-5)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)
    q = torch.randn(5, 3, d)
    torch.testing.assert_close(
        (rotation.rotate(q) * y).sum(-1), (q * x).sum(-1), rtol=1e-4, atol=1e-4
    )
    # blockwise: a vector zero outside one block stays zero outside it
    e = torch.zeros(d)
    e[:block] = torch.randn(block)
    assert rotation.rotate(e)[block:].abs().max() == 0 if d > block else True


def test_rotation_spreads_an_outlier_channel() -> None:
    """The reason for the rotation: one large channel becomes D values of equal magnitude."""
    x = torch.zeros(128)
    x[5] = 64.0
    y = rotation.rotate(x)
    torch.testing.assert_close(y.abs(), torch.full((128,), 64.0 / 128**0.5))


def test_signs_are_fixed_per_head_size() -> None:
    a, b = rotation.hadamard_signs(128), rotation.hadamard_signs(128)
    assert torch.equal(a, b) and set(a.tolist()) == {-1.0, 1.0}
    assert not torch.equal(rotation.hadamard_signs(64), rotation.hadamard_signs(128)[:64])


def test_the_rotation_reads_its_signs_made_once_per_head_size_and_device() -> None:
    """``rotate`` / ``unrotate`` run inside CUDA-graph captures (eager 4-bit writes), where a
    host-to-device copy per call would raise: they read ``signs_on``'s one tensor per (d,
    device), equal to ``hadamard_signs``."""
    rotation.signs_on.cache_clear()
    x = torch.randn(3, 2, 128)
    for _ in range(3):
        rotation.unrotate(rotation.rotate(x))
    assert rotation.signs_on.cache_info().misses == 1
    assert rotation.signs_on(128, x.device) is rotation.signs_on(128, torch.device("cpu"))
    assert torch.equal(rotation.signs_on(128, x.device), rotation.hadamard_signs(128))


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


def _sq_err(x: torch.Tensor, packed: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    return (quant.dequantize_int4_per_token_head(packed, stored) - x).square().sum(-1)


@pytest.mark.parametrize("symmetric", [False, True])
def test_mse_clipping_never_loses_to_the_full_range_and_wins_on_gaussian_rows(
    symmetric: bool,
) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 4, 128, generator=g)
    full = _sq_err(x, *quant.quantize_int4_per_token_head(x, symmetric))
    ratios = (1.0, 0.9, 0.8, 0.7)
    packed, stored = quant.quantize_int4_per_token_head(x, symmetric, clip_ratios=ratios)
    clipped = _sq_err(x, packed, stored)
    assert (clipped <= full).all()
    assert clipped.sum() < 0.95 * full.sum()  # a Gaussian row's max is a tail worth clipping
    # each row's error is the least of the ratios tried one at a time
    each = torch.stack(
        [
            _sq_err(x, *quant.quantize_int4_per_token_head(x, symmetric, clip_ratios=(r,)))
            for r in ratios
        ]
    )
    torch.testing.assert_close(clipped, each.min(0).values)
    if not symmetric:
        _, zp = quant.split_scale(stored)
        assert ((zp >= 0) & (zp <= 15)).all()


def test_mse_clipping_keeps_the_full_range_where_it_is_exact() -> None:
    ramp = torch.arange(16.0)  # exactly on the 16 codes of the full range: error 0 there
    packed, stored = quant.quantize_int4_per_token_head(ramp, clip_ratios=(0.9, 1.0, 0.6))
    assert quant.split_scale(stored)[0].item() == 1.0
    assert torch.equal(quant.dequantize_int4_per_token_head(packed, stored), ramp)


@pytest.mark.parametrize("ratios", [(), (1.0, 0.0), (1.2,)])
def test_bad_clip_ratios_are_refused(ratios: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="clip ratios must be in"):
        quant.quantize_int4_per_token_head(torch.randn(2, 8), clip_ratios=ratios)


def test_grouped_codes_have_one_scale_per_group() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, 128, generator=g)
    x[..., 64:] *= 50  # the second half of each head is 50x the first
    whole = quant.quantize_int4_per_token_head(x)
    same = quant.quantize_int4_grouped(x, 128)
    assert torch.equal(same[0], whole[0]) and torch.equal(same[1], whole[1][..., None])
    packed, stored = quant.quantize_int4_grouped(x, 32)
    assert packed.shape == (5, 2, 64) and stored.shape == (5, 2, 4)
    y = quant.dequantize_int4_grouped(packed, stored)
    scale, _ = quant.split_scale(stored)
    err = (y - x).abs().unflatten(-1, (4, 32))
    assert (err <= scale.unsqueeze(-1) * 0.5 * (1 + 1e-5) + 1e-6).all()
    # the small half no longer shares the large half's step
    small = quant.dequantize_int4_per_token_head(*whole)[..., :64] - x[..., :64]
    assert (y[..., :64] - x[..., :64]).square().sum() < 0.01 * small.square().sum()


@pytest.mark.parametrize("group", [0, 3, 48, 256])
def test_a_group_that_does_not_divide_the_head_is_refused(group: int) -> None:
    with pytest.raises(ValueError, match="group must be even and divide the head size 128"):
        quant.quantize_int4_grouped(torch.randn(2, 128), group)
