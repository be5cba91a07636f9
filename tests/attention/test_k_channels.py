"""K channel scaling of ``int4_per_token_head`` layers (``spec.KChannelScale``,
``attention/k_channels.py``) on the CPU: the scores it leaves unchanged, the layer's cache and
output against the plain int4 layer fed the scaled q and k, the fused compiled flow bit for bit,
the calibration math, the tensor-parallel split and the refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.support.passes import (
    check_layer0_fuses_and_equals_eager,
    make_batch,
    make_specs,
    no_compile_caches,
    pages_for,
    qkv,
)
from torch_kvq.attention import Attention, quant
from torch_kvq.attention.context import forward_context
from torch_kvq.attention.k_channels import ChannelStats, scale_qk
from torch_kvq.attention.kernels.reference import ReferenceKernel
from torch_kvq.distributed import shard_specs
from torch_kvq.models import build_model, generate
from torch_kvq.passes import make_kvq_backend
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig
from torch_kvq.spec_channels import KChannelScale
from torch_kvq.spec_resolve import resolve_layer_specs

MODE = "int4_per_token_head"


def channel(kh: int = 2, d: int = 32, centred: bool = True, seed: int = 0) -> KChannelScale:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(kh, d, generator=g) * 4 + 0.25
    return KChannelScale(scale, torch.randn(kh, d, generator=g) if centred else None)


def with_channels(specs, layer: int, ch: KChannelScale):
    return tuple(replace(s, k_channel=ch) if s.index == layer else s for s in specs)


def test_scaling_leaves_every_softmax_unchanged() -> None:
    """(q * s) . ((k - mean) / s) = q . k - q . mean: each query's scores shift by one constant."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, 8, 32, generator=g).double(), torch.randn(7, 2, 32, generator=g).double()
    ch = channel()
    s, mu = (torch.tensor(x, dtype=torch.float64) for x in (ch.scale, ch.mean))
    qs, ks = scale_qk(q, k, s, mu)
    rep = lambda x: x.repeat_interleave(4, 1)  # noqa: E731  (query head h reads kv head h // 4)
    before = torch.einsum("thd,uhd->htu", q, rep(k)).softmax(-1)
    after = torch.einsum("thd,uhd->htu", qs, rep(ks)).softmax(-1)
    torch.testing.assert_close(after, before, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(ks, k)  # the cache sees other values


@pytest.mark.parametrize("centred", [True, False])
def test_layer_equals_plain_int4_fed_the_scaled_q_and_k(centred: bool) -> None:
    """The scaled layer's cache and output are, bit for bit, those of a plain int4 layer given
    scale_qk's q and k; its output is attention over the keys read back in the model's basis."""
    specs = make_specs(1, MODE, dtype=torch.float32)
    ch = channel(centred=centred)
    (scaled_spec,) = with_channels(make_specs(1, MODE, dtype=torch.float32), 0, ch)
    plan = [(0, 5), (3, 1), (0, 2)]
    md, (q, k, v) = make_batch(plan, pages_for(plan)), qkv(8, (8, 2), 32, torch.float32)
    plain, scaled = Attention(specs[0], pages_for(plan)), Attention(scaled_spec, pages_for(plan))
    assert scaled.k_channel_scale.shape == (2, 32) and plain.k_channel_scale is None
    assert (scaled.k_channel_mean is not None) == centred
    with torch.no_grad(), forward_context(md, specs, ReferenceKernel()):
        want = plain(*scale_qk(q, k, scaled.k_channel_scale, scaled.k_channel_mean), v)
    with torch.no_grad(), forward_context(md, (scaled_spec,), ReferenceKernel()):
        got = scaled(q, k, v)
    assert torch.equal(got, want)
    assert torch.equal(scaled.kv_cache, plain.kv_cache) and torch.equal(
        scaled.kv_scale, plain.kv_scale
    )
    assert "k_channel=scaled" in repr(scaled)


def test_scaled_keys_lose_less_than_plain_int4_where_q_ignores_the_big_channels() -> None:
    """The point of it: k with a few large channels that q barely reads; scaled, the 4-bit round
    trip of the scores q . k errs far less than plain int4's."""
    g = torch.Generator().manual_seed(2)
    k = torch.randn(256, 1, 64, generator=g)
    k[..., :4] *= 30  # large k channels ...
    q = torch.randn(256, 1, 64, generator=g)
    q[..., :4] *= 0.05  # ... that q barely weighs
    stats = ChannelStats()
    stats.add(q, k)
    s, mu = stats.scale_and_mean()
    qs, ks = scale_qk(q, k, s, mu)
    rt = lambda x: quant.dequantize_int4_rotated(*quant.quantize_int4_rotated(x))  # noqa: E731
    exact = torch.einsum("td,ud->tu", qs[:, 0], ks[:, 0])
    err_scaled = (torch.einsum("td,ud->tu", qs[:, 0], rt(ks)[:, 0]) - exact).square().mean()
    exact0 = torch.einsum("td,ud->tu", q[:, 0], k[:, 0])
    err_plain = (torch.einsum("td,ud->tu", q[:, 0], rt(k)[:, 0]) - exact0).square().mean()
    assert err_scaled < 0.25 * err_plain


def test_compiled_fuses_and_equals_eager_bit_for_bit() -> None:
    check_layer0_fuses_and_equals_eager(with_channels(make_specs(2, MODE, skip=(1,)), 0, channel()))


def test_inductor_fuses_the_scaling_into_the_kernels_before_it() -> None:
    """llama-tiny (bf16, int4 on every layer) compiled with the kvq passes and Inductor (CPU):
    with K channel scales on every layer Inductor generates as many kernels as without (q * s
    and (k - mean) / s join the RoPE kernels: no extra pass over memory), the scaled k reaches
    the cache, and the compiled run's logits stay near the eager one's."""
    import torch._inductor.metrics as metrics

    prompts = [[1, 5, 9, 14, 3], [8, 2, 4]]
    runs = {}
    for scaled in (False, True):
        ch = {i: channel(seed=i) for i in range(4)} if scaled else {}
        cfg = KVCacheConfig(MODE, page_size=4, k_channel_scales=ch)
        model = build_model("llama-tiny", cfg, num_pages=16)
        torch._dynamo.reset()
        metrics.reset()
        with no_compile_caches():
            fwd = torch.compile(model, backend=make_kvq_backend(inner="inductor"), fullgraph=True)
            out = generate(model, prompts, 2, forward=fwd)
        torch._dynamo.reset()
        eager = generate(build_model("llama-tiny", cfg, num_pages=16), prompts, 2,
                         force_tokens=out.tokens)  # fmt: skip
        assert (out.logits - eager.logits).abs().max() < 0.5
        runs[scaled] = (metrics.generated_kernel_count, model.attention_layers[0].kv_cache.clone())
    assert runs[True][0] == runs[False][0] > 0
    assert not torch.equal(runs[True][1], runs[False][1])


def test_calibration_math() -> None:
    """s_c = sqrt(rms(k_c) / rms(q_c)) over tokens (q over the query group), geometric mean 1 per
    kv head, s = 1 on a channel that was always 0; mean is k's per channel."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(10, 4, 8, generator=g), torch.randn(10, 2, 8, generator=g) + 1.0
    q[:, 0:2, 5] = 0.0  # kv head 0's query group never reads channel 5
    stats = ChannelStats()
    stats.add(q[:6], k[:6])
    stats.add(q[6:], k[6:])  # in two calls: the sums add up
    s, mu = stats.scale_and_mean()
    rms_k = k.double().square().mean(0).sqrt()
    rms_q = q.double().reshape(10, 2, 2, 8).square().mean((0, 2)).sqrt()
    raw = (rms_k / rms_q).sqrt()
    raw[0, 5] = 1.0
    want = raw / raw.log().mean(-1, keepdim=True).exp()
    torch.testing.assert_close(s.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mu, k.mean(0))
    assert s.log().mean(-1).abs().max() < 1e-5 and s[0, 5] == pytest.approx(
        1 / raw[0].log().mean().exp()
    )
    with pytest.raises(ValueError, match="no calibration tokens"):
        ChannelStats().scale_and_mean()


def test_tensor_parallel_ranks_hold_their_heads_rows() -> None:
    class TP:  # a rank of two (distributed.TensorParallel's split / part)
        size, rank = 2, 1

        def split(self, n, what):
            return n // 2

        def part(self, n, what):
            return slice(n // 2, n)

    ch = channel(kh=4, d=16)
    infos = [AttentionLayerInfo("a", 8, 4, 16)]
    (spec,) = resolve_layer_specs(KVCacheConfig(MODE, k_channel_scales={0: ch}), infos)
    (local,) = shard_specs([spec], TP())
    assert local.num_kv_heads == 2 and local.k_channel.scale == ch.scale[2:]
    assert local.k_channel.mean == ch.mean[2:]
    assert Attention(local, 2).k_channel_scale.shape == (2, 16)


def test_spec_shows_a_digest_not_the_numbers() -> None:
    infos = [AttentionLayerInfo(f"l{i}", 4, 2, 32) for i in range(2)]
    cfg = KVCacheConfig(MODE, k_channel_scales={"l1": channel(centred=False)})
    a, b = resolve_layer_specs(cfg, infos)
    assert a.as_dict()["k_channel"] is None
    assert b.as_dict()["k_channel"].startswith("scaled ") and len(b.as_dict()["k_channel"]) == 15
    other = resolve_layer_specs(replace(cfg, k_channel_scales={1: channel(seed=5)}), infos)[1]
    assert other.as_dict()["k_channel"].startswith("scaled+centred ") and other != b


@pytest.mark.parametrize(
    "cfg, infos, match",
    [
        (KVCacheConfig("fp8", k_channel_scales={0: channel()}), None,
         r"gives layer 'l0', whose mode is 'fp8_per_tensor'; K channel scaling is an option of "
         r"int4_per_token_head layers only"),
        (KVCacheConfig(MODE, layer_modes={0: "k8v4_per_token_head"},
                       k_channel_scales={0: channel()}), None, "whose mode is 'k8v4_per_token_head'"),
        (KVCacheConfig(MODE, k_channel_scales={0: channel(d=16)}), None,
         r"is 2 x 16; expected num_kv_heads x head_size = 2 x 32"),
        (KVCacheConfig(MODE, k_channel_scales={5: channel()}), None,
         r"k_channel_scales index 5 is out of range; expected an int in \[-2, 1\]"),
        (KVCacheConfig(MODE, k_channel_scales={"nope": channel()}), None,
         "k_channel_scales names unknown layer 'nope'"),
        (KVCacheConfig(MODE, k_channel_scales={0: channel(), "l0": channel()}), None,
         r"gives layer 'l0' twice \(by index and by name\)"),
        (KVCacheConfig(MODE, k_channel_scales={0: channel()}),
         [AttentionLayerInfo("l0", 4, 2, 32, logits_soft_cap=30.0)],
         r"centres k of layer 'l0', which caps its logits \(logits_soft_cap 30.0\)"),
    ],
)  # fmt: skip
def test_refusals(cfg, infos, match) -> None:
    infos = infos or [AttentionLayerInfo(f"l{i}", 4, 2, 32) for i in range(2)]
    with pytest.raises(ValueError, match=match):
        resolve_layer_specs(cfg, infos)


def test_soft_capped_layer_takes_a_scale_without_a_mean() -> None:
    info = AttentionLayerInfo("l0", 4, 2, 32, logits_soft_cap=30.0)
    cfg = KVCacheConfig(MODE, k_channel_scales={0: channel(centred=False)})
    assert resolve_layer_specs(cfg, [info])[0].k_channel is not None


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(scale=[[1.0, -1.0]]), r"k channel scale must be positive finite everywhere, got -1.0"),
        (dict(scale=[[1.0, float("inf")]]), "positive finite everywhere, got inf"),
        (dict(scale=[[1.0], [1.0, 2.0]]), r"rows differ in length: \[1, 2\]"),
        (dict(scale=torch.ones(3)), r"must be 2-D \[num_kv_heads, head_size\], got \(3,\)"),
        (dict(scale=[[1.0, 1.0]], mean=[[0.0, float("nan")]]), "mean must be finite everywhere"),
        (dict(scale=[[1.0, 1.0]], mean=[[0.0]]), r"mean is 1 x 1, its scale 1 x 2"),
        (dict(scale=[]), r"must be \[num_kv_heads\]\[head_size\] numbers"),
    ],
)  # fmt: skip
def test_bad_values_are_refused(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        KChannelScale(**kw)


@pytest.mark.parametrize(
    "value, match",
    [
        ({0: "x"}, r"k_channel_scales\[0\] must be a KChannelScale, got str"),
        (((0, 1, 2),), "must be a \\(layer index or name, KChannelScale\\) pair"),
        (((0, None), (0, None)), "lists layer\\(s\\) 0 more than once"),
    ],
)
def test_config_checks_its_entries(value, match) -> None:
    with pytest.raises(ValueError, match=match):
        KVCacheConfig(MODE, k_channel_scales=value)
