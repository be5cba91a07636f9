"""benchmarks/kv_transform_coding.py: the sorted basis diagonalises the moments it came from, the
one-group plan in the identity basis is the rotated uniform math, and bits by sigma lower the
score error of keys whose channels weigh unequally."""

from __future__ import annotations

import kv_format_study as kfs
import kv_formats as kf
import kv_transform_coding as tc
import pytest
import torch

from torch_kvq.attention import rotation


@pytest.fixture(autouse=True)
def _bases_cleared():
    """``tc.BASES`` (a module global a test fills) empty again after it."""
    yield
    tc.BASES.clear()


def _keys(n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [n, 2, 64], k [n, 2, 64]): channels of very unequal size, correlated by a mixing."""
    g = torch.Generator().manual_seed(3)
    mix = torch.linalg.qr(torch.randn(64, 64, generator=g))[0]
    size = torch.logspace(1, -1.5, 64)
    k = (torch.randn(n, 2, 64, generator=g) * size) @ mix.T
    q = torch.randn(n, 2, 64, generator=g) @ mix.T
    return q, k


def _moments(x: torch.Tensor) -> torch.Tensor:
    return torch.einsum("thd,the->hde", x.double(), x.double()) / x.shape[0]


def test_sorted_basis_diagonalises_and_inverts() -> None:
    q, k = _keys()
    ck, cq = _moments(k), _moments(q)
    t, t_inv, sig = tc.sorted_basis(*kf.k_transform(ck, cq), ck)
    d = t.double() @ ck @ t.double().transpose(-1, -2)
    off = d - torch.diag_embed(d.diagonal(0, -2, -1))
    assert off.abs().max() < 1e-4 * d.abs().max()
    assert torch.all(sig[:, :-1] >= sig[:, 1:])  # largest first
    assert torch.allclose(t @ t_inv, torch.eye(64).expand(2, 64, 64), atol=1e-4)
    assert tc.spectrum(sig[0]) > 2.0  # unequal channels: bits by sigma should gain
    assert tc.spectrum(torch.ones(64, dtype=torch.float64)) == pytest.approx(1.0)


def test_one_group_in_the_identity_basis_is_the_rotated_uniform_math() -> None:
    _, k = _keys(64)
    eye = torch.eye(64).expand(2, 64, 64).contiguous()
    tc.BASES[("tc", 0)] = (eye, eye)
    got = tc.alloc_fake(k, "tc4", 0, kf.uniform_fake)
    want = rotation.unrotate(kf.uniform_fake(rotation.rotate(k), 15))
    assert torch.equal(got, want)
    assert kf.fake_quant(k, "tc4:0").equal(want)


def test_bits_by_sigma_lower_the_score_error_at_the_same_bytes() -> None:
    q, k = _keys()
    ck, cq = _moments(k), _moments(q)
    t, t_inv, _ = tc.sorted_basis(*kf.k_transform(ck, cq), ck)
    tc.BASES[("tc", 0)] = (t, t_inv)
    err = {}
    for fmt in ("tc4", "tc643"):
        kq = tc.alloc_fake(k, fmt, 0, kf.uniform_fake)
        err[fmt] = (torch.einsum("thd,thd->th", q, kq - k)).square().mean()
    assert tc.plan_bytes("643", 64) == tc.plan_bytes("4", 64) == 32
    assert err["tc643"] < err["tc4"] / 2


def test_diagonal_basis_sorts_scaled_channels() -> None:
    _, k = _keys()
    s = torch.rand(2, 64, generator=torch.Generator().manual_seed(5)) + 0.5
    t, t_inv = tc.diag_basis(s, _moments(k))
    y = torch.einsum("hde,the->thd", t, k)
    var = y.square().mean(0)
    assert torch.all(var[:, :-1] >= var[:, 1:])
    assert torch.allclose(torch.einsum("hde,the->thd", t_inv, y), k, atol=1e-4)


def test_o_proj_metric_sums_the_query_groups_columns() -> None:
    w = torch.randn(32, 4 * 8)  # hidden 32, 4 query heads of 8, 2 kv heads
    g = tc.o_proj_metric(w, 2, 8)
    want = w[:, 8:16].T.double() @ w[:, 8:16].double() + w[:, 0:8].T.double() @ w[:, 0:8].double()
    assert torch.allclose(g[0], want)


def test_format_names_and_layer_formats() -> None:
    assert tc.split_format("tcd643") == ("tcd", "643")
    assert tc.split_format("tcv53") == ("tcv", "53")
    assert tc.split_format("tc9") is None and tc.split_format("int4") is None
    assert kfs.layer_formats("tc643/tcv643", 2) == [
        ("tc643:0", "tcv643:0"),
        ("tc643:1", "tcv643:1"),
    ]


def test_water_fill_spends_the_mean_and_favours_large_sigma() -> None:
    assert tc.water_fill(torch.ones(64), 4.0) == ((1.0, 4),)
    plan = tc.water_fill(torch.logspace(1, -1, 64), 3.75)
    assert sum(f * b for f, b in plan) == pytest.approx(3.75)
    bits = [b for _, b in plan]
    assert bits == sorted(bits, reverse=True) and bits[0] > 4 > bits[-1]
    assert tc.split_format("tcw375") == ("tcw", "375") and kf.per_layer_k("tcw375")


def test_half_scales_are_fp16_values_and_cost_little() -> None:
    _, k = _keys(64)
    y = rotation.rotate(k)
    out = kf.uniform_fake(y, 15, half_scale=True)
    for row in out.reshape(-1, 64)[:8]:
        step = row.unique().diff().min()  # one code step: the row's scale
        assert step == step.half().float()
    full = (kf.uniform_fake(y, 15) - y).square().mean()
    half = (out - y).square().mean()
    assert half < 1.01 * full
    assert tc.split_format("tch643") == ("tch", "643") and kf.per_layer_v("tcvh5554")


def test_rectc_gives_the_candidate_to_the_measured_layers_only() -> None:
    got = kfs.layer_formats("rectc:int4s0/int4", 4, sliding={3}, rec_layers=(1,))
    assert got == [("int4s0:0", "int4"), ("tc643:1", "tcv5554:1"), ("int4s0:2", "int4"),
                   ("none", "none")]  # fmt: skip


def test_v_in_its_own_channel_order_needs_no_calibration() -> None:
    _, v = _keys(64)
    assert tc.split_format("tcvih54") == ("tcvih", "54") and tc.split_format("tcvi4")[0] == "tcvi"
    assert not tc.BASES  # nothing calibrated
    want = rotation.unrotate(kf.uniform_fake(rotation.rotate(v), 15))
    assert torch.equal(tc.alloc_fake(v, "tcvi4", 0, kf.uniform_fake), want)
    # two runs of channels, 5 and 4 bits, each its own Hadamard and scale
    got = tc.alloc_fake(v, "tcvi54", 0, kf.uniform_fake)
    for half, levels in ((slice(0, 32), 31), (slice(32, 64), 15)):
        x = v[..., half]
        assert torch.equal(
            got[..., half], rotation.unrotate(kf.uniform_fake(rotation.rotate(x), levels))
        )
    assert (got - v).square().mean() < (want - v).square().mean()
