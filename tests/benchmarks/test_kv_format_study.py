"""benchmarks/kv_formats.py's formats (and kv_format_study.py's config parsing and cache hook): the
uniform math is the int4 mode's bit for bit, the Lloyd-Max formats land on their levels, and K
centred on a zero mean is the mode itself."""

from __future__ import annotations

import kv_format_study as kfs
import kv_formats as kf
import pytest
import torch

from torch_kvq.attention import rotation


@pytest.fixture(autouse=True)
def _calibration_cleared():
    """kv_formats' calibration tables (module globals a test fills) empty again after it."""
    yield
    for table in (kf.MU, kf.S, kf.SV, kf.MUV):
        table.clear()


def _rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 2, 64, generator=g) * torch.linspace(0.1, 3.0, 64)


def test_uniform_four_bits_is_the_modes_math() -> None:
    x = _rows()
    assert torch.equal(kf.fake_quant(x, "u4"), kf.fake_quant(x, "int4"))
    assert not torch.equal(kf.fake_quant(x, "u5"), kf.fake_quant(x, "int4"))


def test_lloyd_max_rows_take_sixteen_levels_of_one_scale() -> None:
    lv = kf.LEVELS[16]
    assert lv.shape == (16,) and torch.allclose(lv, -lv.flip(0)) and 2.7 < float(lv[-1]) < 2.8
    y = kf.nf_fake(rotation.rotate(_rows()), 16)  # [64, 2, 64] rotated rows through nf4
    for row in y.reshape(-1, 64)[:8]:
        assert 2 <= row.unique().numel() <= 16
        scale = row.abs().max() / lv[-1]  # the largest magnitude sits on a level times the scale
        assert torch.allclose((row / scale).unsqueeze(-1).sub(lv).abs().min(-1).values,
                              torch.zeros(64), atol=1e-4)  # fmt: skip


def test_centred_keys_with_a_zero_mean_are_the_mode() -> None:
    x = _rows()
    kf.MU[0] = torch.zeros(2, 64)
    kf.MU[1] = torch.full((2, 64), 5.0)
    kf.S[0] = kf.S[1] = torch.rand(2, 64) + 0.5  # int4c is int4s at alpha 0: s ignored
    assert torch.equal(kf.fake_quant(x, "int4c:0"), kf.fake_quant(x, "int4"))
    shifted = kf.fake_quant(x + 5.0, "int4c:1")
    assert torch.allclose(shifted - 5.0, kf.fake_quant(x, "int4"), atol=1e-5)
    assert kfs.layer_formats("rec:int4c/int4", 3) == [
        ("int4c:0", "int4"), ("int8", "int4"), ("int4c:2", "int4"),
    ]  # fmt: skip


def test_keys_per_channel_follow_each_channels_range() -> None:
    g = torch.Generator().manual_seed(1)
    offsets = torch.randn(1, 2, 64, generator=g) * 8.0  # keys with large per-channel offsets
    x = offsets + 0.1 * torch.randn(64, 2, 64, generator=g)
    err = {f: (kf.fake_quant(x, f) - x).square().mean() for f in ("kc32", "kc16", "int4")}
    assert err["kc16"] <= err["kc32"] < err["int4"] / 4
    y = kf.per_channel(x, 32, rot=False)
    assert all(y[s : s + 32, 0, c].unique().numel() <= 16 for s in (0, 32) for c in range(64))


def test_scaled_keys_with_unit_scales_are_the_mode_and_lower_score_error() -> None:
    """int4s0 with s = 1 is the mode; with s balanced on keys whose channels span 30x in
    magnitude (and queries that do not) the score error q . (k_hat - k) drops."""
    x = _rows()  # channel c's magnitude 0.1 .. 3.0
    kf.S[0] = torch.ones(2, 64)
    kf.S[1] = torch.linspace(0.1, 3.0, 64).sqrt().expand(2, 64)  # sqrt(rms(k_c) / rms(q_c))
    kf.MU[0] = kf.MU[1] = torch.zeros(2, 64)
    assert torch.equal(kf.fake_quant(x, "int4s0:0"), kf.fake_quant(x, "int4"))
    assert torch.equal(kf.fake_quant(x, "int4s:0"), kf.fake_quant(x, "int4"))
    q = torch.randn(256, 2, 64, generator=torch.Generator().manual_seed(2))
    err = {
        f: torch.einsum("qhd,khd->hqk", q, kf.fake_quant(x, f) - x).square().mean()
        for f in ("int4", "int4s0:1")
    }
    assert err["int4s0:1"] < 0.8 * err["int4"]
    assert kfs.layer_formats("rec:int4s/int4", 2) == [("int4s:0", "int4"), ("int8", "int4")]


def test_scale_variants_derive_from_the_balanced_scale() -> None:
    """alpha 0 gives s = 1 (the mode); alpha scales log s by 2 alpha with the geometric mean kept
    at 1; s tied across RoPE pairs is equal on c and c + D/2 and commutes with rotate_half."""
    g = torch.Generator().manual_seed(3)
    s = torch.rand(2, 64, generator=g) * 3 + 0.2
    s = s / s.log().mean(-1, keepdim=True).exp()  # geometric mean 1 per kv head, as calibrated
    kf.S[0] = s
    x = _rows()
    assert torch.equal(kf.smooth_scale(s, 0.0), torch.ones(2, 64))
    assert torch.equal(kf.fake_quant(x, "int4s0a00:0"), kf.fake_quant(x, "int4"))
    assert torch.equal(kf.fake_quant(x, "int4s0a50:0"), kf.fake_quant(x, "int4s0:0"))
    a35 = kf.smooth_scale(s, 0.35)
    assert torch.allclose(a35.log(), 0.7 * s.log(), atol=1e-5)
    tied = kf.smooth_scale(s, 0.5, pairs=True)
    assert torch.equal(tied[:, :32], tied[:, 32:])
    assert torch.allclose(tied[:, :32], (s[:, :32] * s[:, 32:]).sqrt(), atol=1e-6)
    for v in (a35, tied):
        assert torch.allclose(v.log().mean(-1), torch.zeros(2), atol=1e-5)

    def rope(t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # transformers' rotate_half
        inv = 10000.0 ** (-torch.arange(32) / 32)
        ang = torch.cat([pos[:, None] * inv] * 2, -1)[:, None, :]  # [T, 1, D]
        return t * ang.cos() + torch.cat([-t[..., 32:], t[..., :32]], -1) * ang.sin()

    pos = torch.arange(64.0)
    assert torch.allclose(rope(x / tied, pos), rope(x, pos) / tied, atol=1e-5)
    assert not torch.allclose(rope(x / s, pos), rope(x, pos) / s, atol=1e-2)
    want = kf.scaled_int4(x, 0, centre=False, alpha=0.5, pairs=True)
    assert torch.equal(kf.fake_quant(x, "int4s0p:0"), want)
    named = ("int4s0a35", "int4sp", "int4s0a65p", "int4", "nf4", "int4s0a5")
    assert [kf.per_layer_k(f) for f in named] == [True, True, True, False, False, False]


def test_full_prefix_leaves_sliding_layers_in_the_model_dtype() -> None:
    """Gemma-3's layout: every 6th layer full attention. "full:" quantizes only those; "rec:" is
    the preset's map (int8 K on its layers, sliding layers "none"); no prefix: every layer."""
    sliding = frozenset(i for i in range(12) if i % 6 != 5)
    fmts = kfs.layer_formats("full:int4s0/int4", 12, sliding)
    assert [i for i, f in enumerate(fmts) if f != ("none", "none")] == [5, 11]
    assert fmts[5] == ("int4s0:5", "int4") and fmts[11] == ("int4s0:11", "int4")
    assert kfs.layer_formats("rec:int4/int4", 12, sliding, (5, 11)) == kfs.layer_formats(
        "full:int8/int4", 12, sliding
    )
    assert kfs.layer_formats("int4/int4", 12, sliding) == [("int4", "int4")] * 12
    assert kfs.layer_formats("full:int4/nf4", 3) == [("int4", "nf4")] * 3  # no sliding layers
    assert kfs.parse_config("full:rec:int4s/int4") == ({"full", "rec"}, "int4s", "int4")


def test_five_bit_scaled_keys_err_less_than_four_bit_ones() -> None:
    """u5s0 with s = 1 is u5 (the uniform math at 31 levels); u5s0 / u5s with a balanced s keep
    int4s's scaling and err about 4x less than int4s0 (one more bit halves the step)."""
    x = _rows()
    kf.S[0] = torch.ones(2, 64)
    kf.S[1] = torch.linspace(0.1, 3.0, 64).sqrt().expand(2, 64)
    kf.MU[0] = kf.MU[1] = torch.zeros(2, 64)
    assert torch.equal(kf.fake_quant(x, "u5s0:0"), kf.fake_quant(x, "u5"))
    err = {f: (kf.fake_quant(x, f) - x).square().mean() for f in ("int4s0:1", "u5s0:1")}
    assert 2.5 * err["u5s0:1"] < err["int4s0:1"] < 6 * err["u5s0:1"]
    assert torch.equal(kf.fake_quant(x, "u5s:1"), kf.fake_quant(x, "u5s0:1"))  # mu = 0
    assert [kf.per_layer_k(f) for f in ("u5s", "u5s0", "u5")] == [True, True, False]
    assert kfs.layer_formats("rec5:int4s/int4", 3, rec_layers=(1,)) == [
        ("int4s:0", "int4"), ("u5s0:1", "int4"), ("int4s:2", "int4"),
    ]  # fmt: skip


def test_full_transform_of_diagonal_moments_is_the_channel_scale() -> None:
    """int4w's M for diagonal second moments is diag(1 / s) with int4s's s = sqrt(rms(k_c) /
    rms(q_c)) (up to one constant per kv head), and M^-1 inverts it; for a rotated basis M turns
    with it (a full transform sees what a diagonal one cannot)."""
    g = torch.Generator().manual_seed(4)
    rk, rq = torch.rand(2, 16, generator=g) + 0.1, torch.rand(2, 16, generator=g) + 0.1
    ck, cq = torch.diag_embed(rk.double().square()), torch.diag_embed(rq.double().square())
    m, m_inv = kf.k_transform(ck, cq)
    s = (rk / rq).sqrt()
    d = m.diagonal(0, -2, -1) * s  # constant per kv head
    assert torch.allclose(d, d[:, :1].expand_as(d), rtol=1e-4)
    assert torch.allclose(
        m - torch.diag_embed(m.diagonal(0, -2, -1)), torch.zeros_like(m), atol=1e-6
    )
    assert torch.allclose(m @ m_inv, torch.eye(16).expand(2, 16, 16), atol=1e-5)
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64))
    m2, _ = kf.k_transform(q @ ck @ q.T, q @ cq @ q.T)
    assert torch.allclose(m2.double(), q @ m.double() @ q.T, atol=1e-4)
    assert kf.per_layer_k("int4w") and kf.per_layer_k("u5w0")


def test_scaled_values_with_unit_scales_are_the_mode() -> None:
    """int4vs0 with s = 1 is int4; int4vs shifts by its mean exactly as int4c does for K; V formats
    calibrated per layer are written "fmt:layer" by layer_formats."""
    x = _rows()
    kf.SV[0] = torch.ones(2, 64)
    kf.MUV[0] = torch.full((2, 64), 5.0)
    assert torch.equal(kf.fake_quant(x, "int4vs0:0"), kf.fake_quant(x, "int4"))
    shifted = kf.fake_quant(x + 5.0, "int4vs:0")
    assert torch.allclose(shifted - 5.0, kf.fake_quant(x, "int4"), atol=1e-5)
    assert kfs.layer_formats("int8/int4vs", 2) == [("int8", "int4vs:0"), ("int8", "int4vs:1")]


def test_exact_positions_parse_sink_and_control_prefixes() -> None:
    assert kfs.exact_positions("sink4:int4/int4") == ((0, 4, "kv"), "int4/int4")
    assert kfs.exact_positions("mid2:rec:int4s/int4") == ((16, 18, "kv"), "rec:int4s/int4")
    assert kfs.exact_positions("vsink1:int4/int4") == ((0, 1, "v"), "int4/int4")
    assert kfs.exact_positions("full:int4/int4") == (None, "full:int4/int4")


def test_cache_pre_hook_keeps_the_exact_positions_as_they_came() -> None:
    """On a real model's forward: rows at the kept positions reach the layer unchanged, every
    other row as the format's round trip."""
    from torch_kvq import KVCacheConfig
    from torch_kvq.models import build_model, generate

    lm = build_model("llama-tiny", KVCacheConfig(), num_pages=8, dtype=torch.float32)
    seen = []

    def before(mod, a, kw):
        from torch_kvq.attention.context import get_forward_context

        pos = get_forward_context().metadata_for(mod.spec).positions
        seen.append([a[1].clone(), pos.clone()])

    def after(mod, a, kw):
        seen[-1].append(a[1].clone())

    layer = lm.attention_layers[0]
    hs = [layer.register_forward_pre_hook(before, with_kwargs=True),
          layer.register_forward_pre_hook(kfs.cache_pre_hook(("int4", "int4"), (0, 2, "kv")), with_kwargs=True),
          layer.register_forward_pre_hook(after, with_kwargs=True)]  # fmt: skip
    try:
        generate(lm, [list(range(3, 10)), list(range(5, 9))], 2)
    finally:
        for h in hs:
            h.remove()
    assert len(seen) == 2  # the prefill and one decode step
    k, pos, got = seen[0]
    keep = pos < 2
    assert keep.sum() == 4 and not keep.all()
    assert torch.equal(got[keep], k[keep])
    assert torch.equal(got[~keep], kf.fake_quant(k, "int4")[~keep])
    assert not torch.equal(got[~keep], k[~keep])
