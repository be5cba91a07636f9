"""The Attention layer's eager (unfused) form against an independent dense computation."""

from __future__ import annotations

import pytest
import torch

from tests.support.attention import make_layers
from torch_kvq.attention import (
    OutOfPagesError,
    PageAllocator,
    ReferenceKernel,
    calibrate_kv_scales,
    forward_context,
    ref_attention,
    registry,
)
from torch_kvq.spec import KVCacheConfig
from torch_kvq.spec_modes import FP8_DTYPE


def sdpa_reference(q, k, v, window=None, soft_cap=None):
    """One sequence, causal, written independently of ref_attention (per-query loop)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, 1)
    v = v.float().repeat_interleave(group, 1)
    L, Tq = k.shape[0], q.shape[0]
    out = []
    for i in range(Tq):
        pos = L - Tq + i
        lo = 0 if window is None else max(0, pos - window + 1)
        s = torch.einsum("hd,khd->hk", q[i].float(), k[lo : pos + 1]) / q.shape[-1] ** 0.5
        if soft_cap:
            s = soft_cap * torch.tanh(s / soft_cap)
        out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v[lo : pos + 1]))
    return torch.stack(out)


def run_steps(attn, alloc, steps, heads, head_size, dtype=torch.bfloat16, seed=0):
    """Run prefill + decode steps; returns per-sequence full k/v history and outputs."""
    g = torch.Generator().manual_seed(seed)
    hist = {}
    outs = []
    for step in steps:
        md = alloc.build_batch(step)
        T = md.num_tokens
        q = torch.randn(T, heads[0], head_size, generator=g).to(dtype)
        k = torch.randn(T, heads[1], head_size, generator=g).to(dtype)
        v = torch.randn(T, heads[1], head_size, generator=g).to(dtype)
        with forward_context(md, [attn.spec], ReferenceKernel()):
            out = attn(q, k, v)
        start = 0
        for sid, n in step:
            kk, vv = hist.get(sid, (k[:0], v[:0]))
            hist[sid] = (
                torch.cat([kk, k[start : start + n]]),
                torch.cat([vv, v[start : start + n]]),
            )
            outs.append((sid, q[start : start + n], out[start : start + n], hist[sid]))
            start += n
    return outs


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["sliding", "global"])
@pytest.mark.parametrize("soft_cap", [None, 30.0])
def test_bf16_layer_matches_dense(alloc, layer_idx, soft_cap) -> None:
    specs, attns = make_layers(KVCacheConfig("auto", page_size=4), soft_cap=soft_cap)
    attn = attns[layer_idx]
    steps = [[("a", 9), ("b", 3)], [("a", 1), ("b", 1)], [("b", 1), ("a", 1)]]
    for sid, q, out, (k, v) in run_steps(attn, alloc, steps, (8, 2), 32):
        want = sdpa_reference(q, k, v, attn.spec.sliding_window, soft_cap)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2, msg=f"seq {sid}")


def test_fp8_layer_quantizes_dequantizes_and_attends(alloc) -> None:
    specs, attns = make_layers(
        KVCacheConfig("fp8", page_size=4, default_k_scale=0.02, default_v_scale=0.03)
    )
    attn = attns[1]
    assert attn.kv_cache.dtype == FP8_DTYPE
    steps = [[("a", 7), ("b", 2)], [("a", 1), ("b", 1)]]
    for sid, q, out, (k, v) in run_steps(attn, alloc, steps, (8, 2), 32):
        kq = ((k.float() / 0.02).clamp(-448, 448).to(FP8_DTYPE).float() * 0.02).bfloat16()
        vq = ((v.float() / 0.03).clamp(-448, 448).to(FP8_DTYPE).float() * 0.03).bfloat16()
        want = sdpa_reference(q, kq, vq)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2, msg=f"seq {sid}")
        # and it is actually lossy compared with the unquantized k/v
        assert (sdpa_reference(q, k, v) - want).abs().max() > 1e-3


def test_cache_dtypes_and_bytes() -> None:
    specs, attns = make_layers(KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=4))
    skipped, quantized = attns
    assert skipped.kv_cache.dtype == torch.bfloat16
    assert quantized.kv_cache.dtype == FP8_DTYPE
    assert quantized.kv_cache.nbytes * 2 == skipped.kv_cache.nbytes
    assert quantized.kv_cache.shape == skipped.kv_cache.shape == (16, 2, 4, 2, 32)


def test_torch_quant_form_equals_op_form(alloc) -> None:
    cfg = KVCacheConfig("fp8", page_size=4, default_k_scale=0.05, default_v_scale=0.05)
    _, (_, a_op) = make_layers(cfg, quant_form="op")
    _, (_, a_torch) = make_layers(cfg, quant_form="torch")
    md = alloc.build_batch([("a", 6)])
    q, k, v = (
        torch.randn(6, 8, 32).bfloat16(),
        torch.randn(6, 2, 32).bfloat16(),
        torch.randn(6, 2, 32).bfloat16(),
    )
    with forward_context(md, [a_op.spec, a_torch.spec], ReferenceKernel()):
        o1, o2 = a_op(q, k, v), a_torch(q, k, v)
    assert torch.equal(a_op.kv_cache.view(torch.uint8), a_torch.kv_cache.view(torch.uint8))
    assert torch.equal(o1, o2)


def test_no_forward_context_is_a_clear_error() -> None:
    _, (attn, _) = make_layers(KVCacheConfig(page_size=4))
    q, k = torch.randn(1, 8, 32).bfloat16(), torch.randn(1, 2, 32).bfloat16()
    with pytest.raises(RuntimeError, match="no kvq forward context is set"):
        attn(q, k, k)


def test_layer_missing_from_context(alloc) -> None:
    specs, (a0, a1) = make_layers(KVCacheConfig(page_size=4))
    md = alloc.build_batch([("a", 1)])
    q, k = torch.randn(1, 8, 32).bfloat16(), torch.randn(1, 2, 32).bfloat16()
    with (
        forward_context(md, [a0.spec], ReferenceKernel()),
        pytest.raises(KeyError, match="not in the active forward context"),
    ):
        a1(q, k, k)


@pytest.mark.parametrize("what", ["q_dtype", "q_heads", "k_tokens"])
def test_mismatched_inputs(alloc, what) -> None:
    specs, (attn, _) = make_layers(KVCacheConfig(page_size=4))
    md = alloc.build_batch([("a", 3)])
    q, k = torch.randn(3, 8, 32).bfloat16(), torch.randn(3, 2, 32).bfloat16()
    if what == "q_dtype":
        q, match = q.half(), "q has dtype torch.float16, expected torch.bfloat16"
    elif what == "q_heads":
        q, match = (
            torch.randn(3, 4, 32).bfloat16(),
            r"q has shape \(3, 4, 32\), expected \(3, 8, 32\)",
        )
    else:
        k, match = (
            torch.randn(2, 2, 32).bfloat16(),
            r"k has shape \(2, 2, 32\), expected \(3, 2, 32\)",
        )
    with (
        forward_context(md, [attn.spec], ReferenceKernel()),
        pytest.raises(ValueError, match=match),
    ):
        attn(q, k, k)


def test_page_size_mismatch_between_batch_and_layer() -> None:
    specs, _ = make_layers(KVCacheConfig(page_size=8))
    md = PageAllocator(4, 4).build_batch([("a", 1)])
    with pytest.raises(
        ValueError, match="page_size 8 but the batch metadata was built with page_size 4"
    ):
        with forward_context(md, specs, ReferenceKernel()):
            pass


def test_out_of_pages_leaves_other_sequences_intact() -> None:
    specs, (attn, _) = make_layers(KVCacheConfig(page_size=4), num_pages=3)
    alloc = PageAllocator(3, 4)
    md = alloc.build_batch([("a", 6)])
    k = torch.randn(6, 2, 32).bfloat16()
    with forward_context(md, [attn.spec], ReferenceKernel()):
        attn(torch.randn(6, 8, 32).bfloat16(), k, k)
    before = attn.kv_cache.clone()
    with pytest.raises(OutOfPagesError):
        alloc.build_batch([("a", 1), ("b", 8)])
    assert torch.equal(attn.kv_cache, before)
    assert alloc.seq_len("a") == 6 and alloc.pages("a") == (0, 1)


def test_ref_attention_window_one_sees_only_itself() -> None:
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    pos = torch.arange(4)
    out = ref_attention(q, k, v, pos, pos, 8**-0.5, sliding_window=1)
    torch.testing.assert_close(out, v)


def test_duplicate_live_layer_name_is_rejected() -> None:
    specs, attns = make_layers(KVCacheConfig(page_size=4))
    from torch_kvq.attention import Attention

    with pytest.raises(ValueError, match="already used by another live layer"):
        Attention(specs[0], 4)
    assert registry.lookup(specs[0].name) is specs[0]
    with pytest.raises(KeyError, match="unknown attention layer 'nope'"):
        registry.lookup("nope")


def test_calibration_amax_over_448(alloc) -> None:
    specs, attns = make_layers(KVCacheConfig(page_size=4))
    model = torch.nn.ModuleList(attns)
    md = alloc.build_batch([("a", 5)])
    k = torch.zeros(5, 2, 32).bfloat16()
    k[2, 1, 3] = -8.96
    v = torch.full((5, 2, 32), 0.5).bfloat16()

    def run() -> None:
        with forward_context(md, specs, ReferenceKernel()):
            for a in attns:
                a(torch.randn(5, 8, 32).bfloat16(), k, v)

    scales = calibrate_kv_scales(model, run)
    assert set(scales) == {s.name for s in specs}
    ks, vs = scales[specs[0].name]
    assert ks == pytest.approx(8.96 / 448, rel=1e-2) and vs == pytest.approx(0.5 / 448)
    with pytest.raises(ValueError, match="no torch_kvq Attention layers"):
        calibrate_kv_scales(torch.nn.Linear(2, 2), lambda: None)


@pytest.mark.parametrize(
    ("which", "bad", "match"),
    [
        ("v", float("nan"), "v amax nan"),
        ("v", float("inf"), "v amax inf"),
        ("k", 0.0, "k amax 0.0"),
    ],
)
def test_calibration_refuses_an_amax_without_scale(
    alloc, which: str, bad: float, match: str
) -> None:
    """v with NaN / inf in a second step (after a finite one), or k all zeros in every step: an
    error naming the layer and k or v, never a silent scale of 1.0."""
    specs, attns = make_layers(KVCacheConfig(page_size=4), n=1)
    md = alloc.build_batch([("a", 5)])
    good = torch.randn(5, 2, 32).bfloat16()
    poison = torch.full_like(good, bad)
    steps = [(good, good), (good, poison)] if which == "v" else [(poison, good)] * 2

    def run() -> None:
        with forward_context(md, specs, ReferenceKernel()):
            for k, v in steps:
                attns[0](torch.randn(5, 8, 32).bfloat16(), k, v)

    with pytest.raises(ValueError, match=rf"layer '{specs[0].name}': {match} gives no FP8 scale"):
        calibrate_kv_scales(torch.nn.ModuleList(attns), run)
