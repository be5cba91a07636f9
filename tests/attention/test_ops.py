"""The kvq custom ops: torch.library.opcheck, fused == unfused, and refusals."""

from __future__ import annotations

import pytest
import torch

from tests.support.attention import (
    VIEW_LAYOUTS,
    as_cache_view,
    as_view,
    check_ops_on_views,
    make_layers,
    opcheck,
)
from torch_kvq.attention import PageAllocator, ReferenceKernel, forward_context
from torch_kvq.spec import KVCacheConfig
from torch_kvq.spec_modes import FP8_DTYPE

ops = torch.ops.kvq


@pytest.fixture
def setup():
    cfg = KVCacheConfig(
        "fp8", skip_layers=(0,), page_size=4, default_k_scale=0.04, default_v_scale=0.03
    )
    specs, attns = make_layers(cfg, num_pages=8)
    md = PageAllocator(8, 4).build_batch([("a", 5), ("b", 1), ("c", 3)])
    g = torch.Generator().manual_seed(0)
    T = md.num_tokens
    q = torch.randn(T, 8, 32, generator=g).bfloat16()
    k = torch.randn(T, 2, 32, generator=g).bfloat16()
    v = torch.randn(T, 2, 32, generator=g).bfloat16()
    with forward_context(md, specs, ReferenceKernel()):
        yield specs, attns, q, k, v


def test_opcheck_every_op(setup, fp8_safe_allclose) -> None:
    (skip, quant), (a_skip, a_quant), q, k, v = setup
    kq, vq = ops.quantize_fp8(k, 0.04), ops.quantize_fp8(v, 0.03)
    cases = [
        (ops.quantize_fp8.default, (k, 0.04)),
        (
            ops.dequantize_kv_cache.default,
            (a_quant.kv_cache, 0.04, 0.03, torch.float32, quant.name),
        ),
        (ops.cache_write.default, (kq, vq, a_quant.kv_cache.clone(), quant.name)),
        (ops.cache_write.default, (k, v, a_skip.kv_cache.clone(), skip.name)),
        (ops.quant_cache_write.default, (k, v, a_quant.kv_cache.clone(), 0.04, 0.03, quant.name)),
        (ops.paged_attention.default, (q, a_skip.kv_cache, skip.name)),
        (ops.paged_attention_fp8.default, (q, a_quant.kv_cache, 0.04, 0.03, quant.name)),
        (ops.paged_attention_fp8.default, (q, a_quant.kv_cache, 0.04, 0.03, quant.name, 0.01)),
        (
            ops.quant_cache_write_ts.default,
            (k, v, a_quant.kv_cache.clone(), torch.tensor(0.04), torch.tensor([0.03]), quant.name),
        ),
        (
            ops.paged_attention_fp8.default,
            (q, a_quant.kv_cache, 0.04, 0.03, quant.name, None, torch.tensor(0.01)),
        ),
    ]
    for op, args in cases:
        opcheck(op, args)


@pytest.mark.parametrize("layout", VIEW_LAYOUTS)
def test_opcheck_every_op_on_views(setup, fp8_safe_allclose, layout: str) -> None:
    """q / k / v (and caches) as non-contiguous views: each op returns a new contiguous tensor
    whatever the layout, its fake says exactly that (opcheck compares strides), and the values
    equal those computed from contiguous inputs."""
    (skip, quant), (a_skip, a_quant), q, k, v = setup
    ops.cache_write(k, v, a_skip.kv_cache, skip.name)  # some history in both caches
    ops.quant_cache_write(k, v, a_quant.kv_cache, 0.04, 0.03, quant.name)
    kq, vq = ops.quantize_fp8(k, 0.04), ops.quantize_fp8(v, 0.03)
    c8, c16 = a_quant.kv_cache, a_skip.kv_cache
    qv, kv_, vv, kqv, vqv = (as_view(x, layout) for x in (q, k, v, kq, vq))
    cases = [
        (ops.quantize_fp8, (kv_, 0.04), (k, 0.04)),
        (ops.quantize_fp8, (kv_.float(), 0.04), (k.float(), 0.04)),
        (
            ops.dequantize_kv_cache,
            (as_cache_view(c8), 0.04, 0.03, torch.float32, quant.name),
            (c8, 0.04, 0.03, torch.float32, quant.name),
        ),
        (ops.cache_write, (kqv, vqv, as_cache_view(c8), quant.name), (kq, vq, c8, quant.name)),
        (ops.cache_write, (kv_, vv, as_cache_view(c16), skip.name), (k, v, c16, skip.name)),
        (
            ops.quant_cache_write,
            (kv_, vv, as_cache_view(c8), 0.04, 0.03, quant.name),
            (k, v, c8, 0.04, 0.03, quant.name),
        ),
        (ops.paged_attention, (qv, c16, skip.name), (q, c16, skip.name)),
        (ops.paged_attention, (qv, as_cache_view(c16), skip.name), (q, c16, skip.name)),
        (
            ops.paged_attention_fp8,
            (qv, c8, 0.04, 0.03, quant.name),
            (q, c8, 0.04, 0.03, quant.name),
        ),
        (
            ops.paged_attention_fp8,
            (qv, as_cache_view(c8), 0.04, 0.03, quant.name, 0.01),
            (q, c8, 0.04, 0.03, quant.name, 0.01),
        ),
    ]
    check_ops_on_views(cases)


def test_fused_write_equals_quantize_then_write(setup) -> None:
    (_, quant), (_, a_quant), q, k, v = setup
    c1, c2 = a_quant.kv_cache.clone(), a_quant.kv_cache.clone()
    ops.cache_write(ops.quantize_fp8(k, 0.04), ops.quantize_fp8(v, 0.03), c1, quant.name)
    ops.quant_cache_write(k, v, c2, 0.04, 0.03, quant.name)
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))
    assert c1.view(torch.uint8).any()


def test_tensor_scale_ops_equal_their_float_forms(setup) -> None:
    """On the CPU aten divides by a float32 tensor as by the Python float: same bytes, same output."""
    (_, quant), (_, a_quant), q, k, v = setup
    c1, c2 = a_quant.kv_cache.clone(), a_quant.kv_cache.clone()
    ops.quant_cache_write(k, v, c1, 0.04, 0.03, quant.name)
    ops.quant_cache_write_ts(k, v, c2, torch.tensor(0.04), torch.tensor(0.03), quant.name)
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))
    want = ops.paged_attention_fp8(q, c1, 0.04, 0.03, quant.name, 0.01)
    got = ops.paged_attention_fp8(q, c1, 0.04, 0.03, quant.name, None, torch.tensor(0.01))
    assert got.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_fused_attention_equals_unfused(setup) -> None:
    (_, quant), (_, a_quant), q, k, v = setup
    ops.quant_cache_write(k, v, a_quant.kv_cache, 0.04, 0.03, quant.name)
    dequantized = ops.dequantize_kv_cache(a_quant.kv_cache, 0.04, 0.03, torch.float32, quant.name)
    unfused = ops.paged_attention(q, dequantized, quant.name)
    fused = ops.paged_attention_fp8(q, a_quant.kv_cache, 0.04, 0.03, quant.name)
    assert torch.equal(fused, unfused)  # one semantics: code * scale in fp32, on both paths
    out8 = ops.paged_attention_fp8(q, a_quant.kv_cache, 0.04, 0.03, quant.name, 0.01)
    assert out8.dtype == FP8_DTYPE
    torch.testing.assert_close(
        out8.float() * 0.01, fused.float(), atol=0.1 * fused.abs().max().item(), rtol=0.07
    )


def test_fp8_ops_refuse_a_skipped_layer(setup) -> None:
    (skip, _), (a_skip, _), q, k, v = setup
    with pytest.raises(
        ValueError, match=rf"layer '{skip.name}' is not quantized .*paged_attention_fp8 refused"
    ):
        ops.paged_attention_fp8(q, a_skip.kv_cache.to(FP8_DTYPE), 1.0, 1.0, skip.name)
    with pytest.raises(ValueError, match="quant_cache_write refused"):
        ops.quant_cache_write(k, v, a_skip.kv_cache.to(FP8_DTYPE), 1.0, 1.0, skip.name)


def test_cache_write_rejects_wrong_dtype(setup) -> None:
    (_, quant), (_, a_quant), q, k, v = setup
    with pytest.raises(
        ValueError, match="k has dtype torch.bfloat16, expected torch.float8_e4m3fn"
    ):
        ops.cache_write(k, v, a_quant.kv_cache, quant.name)


def test_paged_attention_rejects_fp8_cache(setup) -> None:
    (_, quant), (_, a_quant), q, k, v = setup
    with pytest.raises(
        ValueError,
        match=r"needs a torch.bfloat16 cache \(or its dequantized float32 one\), got torch.float8_e4m3fn",
    ):
        ops.paged_attention(q, a_quant.kv_cache, quant.name)


def test_dequantize_rejects_non_fp8() -> None:
    with pytest.raises(ValueError, match="expects a float8_e4m3fn cache"):
        ops.dequantize_kv_cache(torch.zeros(1, 2, 4, 2, 8), 1.0, 1.0, torch.float32, "l0")


def test_quantize_saturates() -> None:
    x = torch.tensor([1e6, -1e6, 0.5])
    assert ops.quantize_fp8(x, 1.0).float().tolist() == [448.0, -448.0, 0.5]
