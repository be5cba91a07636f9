"""The per-(token, head) kvq ops: opcheck, fused == unfused (bit for bit), refusals."""

from __future__ import annotations

import pytest
import torch

from tests.support.attention import opcheck, per_token_head_case
from torch_kvq.attention.quant import dequantize_per_token_head, quantize_per_token_head
from torch_kvq.spec_modes import FP8_DTYPE

ops = torch.ops.kvq
MODES = ("int8_per_token_head", "fp8_per_token_head")


@pytest.fixture(params=MODES)
def setup(request):
    with per_token_head_case(request.param) as case:
        yield case


def test_layer_allocates_codes_and_scales(setup) -> None:
    (skip, pth), (a_skip, a_pth), *_ = setup
    assert a_skip.kv_scale is None
    assert a_pth.kv_cache.dtype == pth.mode.code_dtype == pth.storage_dtype
    assert a_pth.kv_scale.dtype == torch.float32
    assert tuple(a_pth.kv_scale.shape) == (8, 2, 2, 4)  # pages, k / v, kv heads, page
    assert "kv_scale=(8, 2, 2, 4)" in repr(a_pth)


def test_opcheck_every_op(setup, fp8_safe_allclose) -> None:
    (_, pth), (_, a), q, k, v, _ = setup
    fmt = pth.mode.per_token_head_format
    kc, ks = ops.quantize_per_token_head(k, fmt)
    vc, vs = ops.quantize_per_token_head(v, fmt)
    cache, scale = a.kv_cache.clone(), a.kv_scale.clone()
    ops.quant_cache_write_per_token_head(k, v, cache, scale, pth.name, "half_away")
    cases = [
        (ops.quantize_per_token_head.default, (k, fmt)),
        (ops.quantize_per_token_head.default, (k.float(), fmt)),
        (
            ops.cache_write_per_token_head.default,
            (kc, vc, ks, vs, a.kv_cache.clone(), a.kv_scale.clone(), pth.name),
        ),
        (
            ops.quant_cache_write_per_token_head.default,
            (k, v, a.kv_cache.clone(), a.kv_scale.clone(), pth.name, "half_even"),
        ),
        (
            ops.dequantize_kv_cache_per_token_head.default,
            (cache, scale, pth.name, torch.float32),
        ),
        (ops.paged_attention_per_token_head.default, (q, cache, scale, pth.name)),
    ]
    for op, args in cases:
        opcheck(op, args)


def test_quantize_op_is_the_quant_math(setup) -> None:
    (_, pth), _, _, k, _, _ = setup
    fmt = pth.mode.per_token_head_format
    codes, scales = ops.quantize_per_token_head(k, fmt)
    want_c, want_s = quantize_per_token_head(k, fmt)
    assert codes.dtype == pth.storage_dtype and scales.shape == k.shape[:2]
    assert torch.equal(codes.view(torch.uint8), want_c.view(torch.uint8))
    assert torch.equal(scales, want_s)
    err = (dequantize_per_token_head(codes, scales) - k.float()).abs()
    assert (err <= scales.unsqueeze(-1) * (0.501 if fmt == "int8" else 16)).all()


@pytest.mark.parametrize("rounding", ["half_away", "half_even"])
def test_fused_write_equals_quantize_then_write(setup, rounding) -> None:
    """The fused write's codes and scales equal the unfused ones, bit for bit."""
    (_, pth), (_, a), _, k, v, md = setup
    fmt = pth.mode.per_token_head_format
    c1, s1 = a.kv_cache.clone(), a.kv_scale.clone()
    c2, s2 = a.kv_cache.clone(), a.kv_scale.clone()
    kc, ks = quantize_per_token_head(k, fmt, rounding)
    vc, vs = quantize_per_token_head(v, fmt, rounding)
    ops.cache_write_per_token_head(kc, vc, ks, vs, c1, s1, pth.name)
    ops.quant_cache_write_per_token_head(k, v, c2, s2, pth.name, rounding)
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8)) and torch.equal(s1, s2)
    # the token at slot 0 (page 1 offset 0 of sequence "a"): its codes and scales where expected
    slot = int(md.slot_mapping[0])
    page, off = divmod(slot, 4)
    assert torch.equal(s1[page, 0, :, off], ks[0]) and torch.equal(s1[page, 1, :, off], vs[0])
    assert torch.equal(c1[page, 0, off].view(torch.uint8), kc[0].view(torch.uint8))


def test_fused_attention_equals_unfused(setup) -> None:
    (_, pth), (_, a), q, k, v, md = setup
    ops.quant_cache_write_per_token_head(k, v, a.kv_cache, a.kv_scale, pth.name, "half_away")
    kv = ops.dequantize_kv_cache_per_token_head(a.kv_cache, a.kv_scale, pth.name, torch.float32)
    pages = md.kv_indices.long()
    want = dequantize_per_token_head(a.kv_cache[pages], a.kv_scale[pages].transpose(-1, -2))
    assert torch.equal(kv[pages], want)  # the batch's pages, in fp32
    unfused = ops.paged_attention(q, kv, pth.name)
    fused = ops.paged_attention_per_token_head(q, a.kv_cache, a.kv_scale, pth.name)
    assert torch.equal(fused, unfused)  # one semantics: code * scale in fp32 on both paths
    exact = ops.paged_attention(q, _bf16_cache(k, v, a.kv_cache.shape, md), pth.name)
    torch.testing.assert_close(fused.float(), exact.float(), atol=0.2, rtol=0.1)


def _bf16_cache(k, v, shape, md) -> torch.Tensor:
    cache = torch.zeros(shape, dtype=torch.float32)
    slots = md.slot_mapping.long()
    cache[slots // shape[2], 0, slots % shape[2]] = k.float()
    cache[slots // shape[2], 1, slots % shape[2]] = v.float()
    return cache


def test_layer_forward_is_the_unfused_ops(setup) -> None:
    (_, pth), (_, a), q, k, v, _ = setup
    out = a(q, k, v)
    fused = ops.paged_attention_per_token_head(q, a.kv_cache, a.kv_scale, pth.name)
    assert torch.equal(out, fused)
    assert a.kv_scale.any()


def test_ops_refuse_a_layer_of_another_mode(setup) -> None:
    (skip, pth), (a_skip, a), q, k, v, _ = setup
    with pytest.raises(
        ValueError,
        match=rf"layer '{skip.name}' has mode none, not a per-\(token, head\) mode; "
        "paged_attention_per_token_head refused",
    ):
        ops.paged_attention_per_token_head(q, a.kv_cache, a.kv_scale, skip.name)
    with pytest.raises(ValueError, match="quant_cache_write_per_token_head refused"):
        ops.quant_cache_write_per_token_head(k, v, a.kv_cache, a.kv_scale, skip.name, "half_away")


def test_ops_check_cache_and_scales(setup) -> None:
    (_, pth), (_, a), q, k, v, _ = setup
    wrong = torch.int8 if pth.storage_dtype == FP8_DTYPE else FP8_DTYPE
    with pytest.raises(ValueError, match=rf"cache dtype {wrong}, expected {pth.storage_dtype}"):
        ops.paged_attention_per_token_head(q, a.kv_cache.to(wrong), a.kv_scale, pth.name)
    with pytest.raises(ValueError, match=r"kv_scale is torch.float32 \(8, 2, 4, 2\), expected "
                       r"float32 \(8, 2, 2, 4\) \(pages, k / v, kv heads, page\)"):  # fmt: skip
        ops.paged_attention_per_token_head(
            q, a.kv_cache, a.kv_scale.transpose(2, 3).contiguous(), pth.name
        )
    with pytest.raises(ValueError, match=r"unknown rounding 'half_up'"):
        ops.quant_cache_write_per_token_head(k, v, a.kv_cache, a.kv_scale, pth.name, "half_up")


def test_quantize_op_rejects_an_unknown_format() -> None:
    with pytest.raises(ValueError, match=r"unknown per-\(token, head\) format 'int2'"):
        ops.quantize_per_token_head(torch.zeros(2, 8), "int2")
