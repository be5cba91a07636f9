"""``int4_per_token_head`` (issue 33) on the CPU: the mode, its packed cache, the write and read of
the reference path (eager and fused, bit for bit), a per-layer map mixing it with bf16 and
``int8_per_token_head`` on a small model, and the refusals (odd head size, the torch-native quant
form, FlashInfer). The CUDA write's Triton program: tests/attention/test_kv_write_int4.py."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests.support.attention import opcheck, per_token_head_case
from tests.support.passes import (
    check_layer0_fuses_and_equals_eager,
    make_specs,
)
from torch_kvq.attention import Attention, quant, rotation, v_layout
from torch_kvq.attention.kernels import FlashInferKernel, KernelUnsupportedError
from torch_kvq.attention.kernels import capabilities as caps
from torch_kvq.attention.kernels.kv_write_per_token_head import write_kv_per_token_head
from torch_kvq.attention.memory import page_bytes
from torch_kvq.models import build_model, generate
from torch_kvq.passes.stamp import make_stamp
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig
from torch_kvq.spec_modes import KVQuantMode
from torch_kvq.spec_resolve import resolve_layer_specs

ops = torch.ops.kvq
MODE = "int4_per_token_head"


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    """quant.py's round trip of the chosen format (the study's ``int4-rot-mse``), in fp32:
    rotate, MSE-clipped asymmetric int4, dequantize, un-rotate."""
    packed, stored = quant.quantize_int4_per_token_head(
        rotation.rotate(x), clip_ratios=quant.INT4_CLIP_RATIOS
    )
    return rotation.unrotate(quant.dequantize_int4_per_token_head(packed, stored))


@pytest.fixture
def setup():
    with per_token_head_case(MODE) as case:
        yield case


def test_mode_spec_and_bytes() -> None:
    mode = KVQuantMode(MODE)
    assert mode.per_token_head and mode.code_dtype == torch.uint8 and mode.codes_per_byte == 2
    assert mode.per_token_head_format == "int4"
    (spec,) = resolve_layer_specs(
        KVCacheConfig(MODE, page_size=16), [AttentionLayerInfo("x", 8, 2, 128)]
    )
    assert spec.code_dim == 64
    # k and v: 2 heads x 64 bytes of codes, plus a 4-byte scale (with its zero point) each
    assert spec.cache_bytes_per_token == 2 * 2 * 64 + 2 * 2 * 4 == 272
    assert spec.scale_bytes_per_token == 16
    assert page_bytes(spec) == 16 * 272  # the memory planner counts codes plus scales


def test_layer_allocates_packed_codes_and_scales(setup) -> None:
    (skip, pth), (a_skip, a), *_ = setup
    assert a_skip.kv_scale is None and a_skip.kv_cache.shape[-1] == 32
    assert a.kv_cache.dtype == torch.uint8 == pth.storage_dtype
    assert tuple(a.kv_cache.shape) == (8, 2, 4, 2, 16)  # pages, k / v, page, KH, D / 2
    assert a.kv_scale.dtype == torch.float32 and tuple(a.kv_scale.shape) == (8, 2, 2, 4)


def test_write_then_read_is_the_fake_quant_round_trip(setup) -> None:
    """The layer's write then the unfused read give, per token, exactly quant.py's round trip,
    and the cache holds quant.py's packed codes and stored scales at each token's slot."""
    (_, pth), (_, a), q, k, v, md = setup
    a(q, k, v)
    kv = ops.dequantize_kv_cache_per_token_head(a.kv_cache, a.kv_scale, pth.name, torch.float32)
    assert kv.shape == (8, 2, 4, 2, 32)
    slots = md.slot_mapping.long()
    pages, offs = slots // 4, slots % 4
    assert torch.equal(kv[pages, 0, offs], fake_quant(k))
    assert torch.equal(kv[pages, 1, offs], fake_quant(v))
    kc, ks = quant.quantize_int4_per_token_head(
        rotation.rotate(k), clip_ratios=quant.INT4_CLIP_RATIOS
    )
    assert torch.equal(a.kv_cache[pages, 0, offs], kc)
    assert torch.equal(a.kv_scale[pages, 0, :, offs], ks)
    # even channel in the low nibble, zero point in the scale's low bits
    codes = torch.stack((kc & 0xF, kc >> 4), -1).flatten(-2)
    scale, zp = quant.split_scale(ks)
    want = rotation.unrotate((codes.float() - zp.unsqueeze(-1)) * scale.unsqueeze(-1))
    assert torch.equal(kv[pages, 0, offs], want)
    # close to k: the rotated int4 error, far below k's scale
    assert (kv[pages, 0, offs] - k.float()).abs().max() < 0.5 * k.float().abs().max()


@pytest.mark.parametrize("rounding", ["half_away", "half_even"])
def test_fused_write_equals_quantize_then_write(setup, rounding) -> None:
    (_, pth), (_, a), _, k, v, _ = setup
    c1, s1 = a.kv_cache.clone(), a.kv_scale.clone()
    c2, s2 = a.kv_cache.clone(), a.kv_scale.clone()
    kc, ks = ops.quantize_per_token_head(k, "int4")
    vc, vs = ops.quantize_per_token_head(v, "int4")
    assert kc.shape == (k.shape[0], 2, 16) and kc.dtype == torch.uint8
    ops.cache_write_per_token_head(kc, vc, ks, vs, c1, s1, pth.name)
    ops.quant_cache_write_per_token_head(k, v, c2, s2, pth.name, rounding)
    assert torch.equal(c1, c2) and torch.equal(s1, s2) and s1.any()


def test_fused_attention_equals_unfused_and_the_layer(setup) -> None:
    (_, pth), (_, a), q, k, v, md = setup
    out = a(q, k, v)
    kv = ops.dequantize_kv_cache_per_token_head(a.kv_cache, a.kv_scale, pth.name, torch.float32)
    fused = ops.paged_attention_per_token_head(q, a.kv_cache, a.kv_scale, pth.name)
    assert torch.equal(fused, ops.paged_attention(q, kv, pth.name))
    assert torch.equal(out, fused)
    slots = md.slot_mapping.long()

    def cache_of(k, v):
        cache = torch.zeros(8, 2, 4, 2, 32)
        cache[slots // 4, 0, slots % 4], cache[slots // 4, 1, slots % 4] = k, v
        return cache

    # attention over quant.py's round trip of k and v, in fp32: the same output, bit for bit
    rt = ops.paged_attention(q, cache_of(fake_quant(k), fake_quant(v)), pth.name)
    assert torch.equal(fused, rt)
    exact = ops.paged_attention(q, cache_of(k.float(), v.float()), pth.name).float()
    assert (fused.float() - exact).abs().mean() < 0.1 * exact.abs().mean()


def test_opcheck_every_op(setup) -> None:
    (_, pth), (_, a), q, k, v, _ = setup
    kc, ks = ops.quantize_per_token_head(k, "int4")
    vc, vs = ops.quantize_per_token_head(v, "int4")
    cache, scale = a.kv_cache.clone(), a.kv_scale.clone()
    ops.quant_cache_write_per_token_head(k, v, cache, scale, pth.name, "half_away")
    cases = [
        (ops.quantize_per_token_head.default, (k, "int4")),
        (
            ops.cache_write_per_token_head.default,
            (kc, vc, ks, vs, a.kv_cache.clone(), a.kv_scale.clone(), pth.name),
        ),
        (
            ops.quant_cache_write_per_token_head.default,
            (k, v, a.kv_cache.clone(), a.kv_scale.clone(), pth.name, "half_away"),
        ),
        (ops.dequantize_kv_cache_per_token_head.default, (cache, scale, pth.name, torch.float32)),
        (ops.paged_attention_per_token_head.default, (q, cache, scale, pth.name)),
    ]
    for op, args in cases:
        opcheck(op, args)


def test_ops_check_the_packed_shapes(setup) -> None:
    (_, pth), (_, a), q, k, v, _ = setup
    kc, ks = ops.quantize_per_token_head(k, "int4")
    with pytest.raises(ValueError, match=r"k has shape .*, expected \(9, 2, 16\)"):
        ops.cache_write_per_token_head(
            k.to(torch.uint8), kc, ks, ks, a.kv_cache, a.kv_scale, pth.name
        )
    unpacked = torch.zeros(8, 2, 4, 2, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"kv_cache has shape \(8, 2, 4, 2, 32\), expected "):
        ops.paged_attention_per_token_head(q, unpacked, a.kv_scale, pth.name)


def test_compiled_fuses_and_equals_eager_bit_for_bit() -> None:
    check_layer0_fuses_and_equals_eager(make_specs(2, MODE, skip=(1,)))


def test_a_map_mixing_int4_int8_and_bf16_runs_eagerly() -> None:
    """llama-tiny (random weights, 4 layers, head 32): layer 0 int4, 1 int8, the rest bf16; each
    layer's cache has its own dtype and shape, each is written, and the run generates."""
    cfg = KVCacheConfig(
        "auto", layer_modes=((0, MODE), (1, "int8_per_token_head"), (2, "bf16")), page_size=4
    )
    model = build_model("llama-tiny", cfg, num_pages=16)
    got = [
        (a.spec.mode.value, a.kv_cache.dtype, a.kv_cache.shape[-1]) for a in model.attention_layers
    ]
    assert got == [
        (MODE, torch.uint8, 16),
        ("int8_per_token_head", torch.int8, 32),
        ("none", torch.bfloat16, 32),
        ("none", torch.bfloat16, 32),
    ]
    assert [a.kv_scale is not None for a in model.attention_layers] == [True, True, False, False]
    assert [s.cache_bytes_per_token for s in model.kv_specs] == [80, 144, 256, 256]
    prompts = [[1, 5, 9, 14, 3, 7, 2, 11, 30, 4, 6], [8, 2, 4]]
    out = generate(model, prompts, 3)
    assert [len(t) for t in out.tokens] == [3, 3] and torch.isfinite(out.logits).all()
    for a in model.attention_layers:
        assert a.kv_cache.view(torch.uint8).any()
        assert a.kv_scale is None or a.kv_scale.any()
    # the int4 layer's cache reads back as its round trip of what was written: logits near bf16's
    bf16 = generate(build_model("llama-tiny", KVCacheConfig(page_size=4), num_pages=16), prompts, 3,
                    force_tokens=out.tokens)  # fmt: skip
    torch.testing.assert_close(out.logits, bf16.logits, atol=0.5, rtol=0.0)


# -- refusals ------------------------------------------------------------------------------------


def test_odd_head_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"layer 0 \('x'\): mode 'int4_per_token_head' packs two "
                       r"4-bit codes per byte, so its head size must be even, got 15"):  # fmt: skip
        resolve_layer_specs(KVCacheConfig(MODE), [AttentionLayerInfo("x", 4, 2, 15)])
    # a non-power-of-two even head size is served (the rotation works in blocks of 32 at D 96)
    (spec,) = resolve_layer_specs(KVCacheConfig(MODE), [AttentionLayerInfo("y", 4, 2, 96)])
    assert spec.code_dim == 48 and rotation.hadamard_block(96) == 32


def test_torch_quant_form_is_refused() -> None:
    (spec,) = make_specs(1, MODE)
    with pytest.raises(ValueError, match=r"has no torch-native quant form .* use quant_form='op'"):
        Attention(spec, 4, quant_form="torch")


@pytest.mark.parametrize("name", [n for n in caps.known_kernels() if n.startswith("flashinfer")])
def test_flashinfer_rows_serve_int4_on_sm90_only(name: str) -> None:
    """Every FlashInfer configuration reads int4 codes in place on sm90 (the Triton decode, the
    compact scratch prefill), so the passes fuse for such a layer there; elsewhere no row lists
    the mode and nothing is fused (the reference kernel serves it everywhere)."""
    (spec,) = resolve_layer_specs(
        KVCacheConfig(MODE, page_size=16), [AttentionLayerInfo("fi.attn", 8, 2, 128)]
    )
    assert caps.unsupported_reason(name, "sm90", spec) is None
    assert make_stamp(spec, name, "sm90").kv_in_place
    why = caps.unsupported_reason(name, "sm80", spec)
    assert why is not None and why.startswith("quant mode 'int4_per_token_head' is not supported")
    assert not make_stamp(spec, name, "sm80").kv_in_place
    assert caps.unsupported_reason("reference", "sm90", spec) is None
    assert make_stamp(spec, "reference", "cpu").kv_in_place


def test_flashinfer_kernel_refuses_int4_off_sm90() -> None:
    (spec,) = resolve_layer_specs(
        KVCacheConfig(MODE, page_size=16), [AttentionLayerInfo("fi.attn", 8, 2, 128)]
    )
    with (
        mock.patch.object(torch.cuda, "is_available", return_value=True),
        mock.patch.object(torch.cuda, "get_device_capability", return_value=(8, 0)),
    ):
        with pytest.raises(
            KernelUnsupportedError,
            match=r"layer 'fi.attn': .* cannot serve it: quant mode 'int4_per_token_head' is not "
            r"supported",
        ):
            FlashInferKernel().check_supported(spec)


def test_cpu_write_of_int4_is_the_aten_form() -> None:
    """On the CPU ``write_kv_per_token_head`` writes int4 with aten ops (CUDA: the Triton program,
    tests/attention/test_kv_write_int4.py)."""
    cache = torch.zeros(2, 2, 4, 2, 16, dtype=torch.uint8)
    scale = torch.zeros(2, 2, 2, 4)
    k = torch.randn(3, 2, 32)
    slots = torch.tensor([0, 1, 2])
    write_kv_per_token_head(cache, scale, k, k, slots, "int4")
    packed, stored = quant.quantize_int4_rotated(k)
    v = v_layout.v_from_cache(cache[0, 1])  # v a token a row
    assert torch.equal(cache[0, 0, :3], packed) and torch.equal(v[:3], packed)
    assert not v[3:].any() and not cache[0, 0, 3:].any()
    assert torch.equal(scale[0, 0, :, :3], stored.T)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page", [8, 16, 32])
def test_v_codes_sit_at_their_positions(d: int, page: int) -> None:
    """A page's 4-bit v codes where the page is a multiple of 16 (head sizes 64, 128, 256): in
    each 16 tokens, the four tokens 4t..4t+3 of a byte column in one 32-bit word, a column group's
    four words in 16 contiguous bytes (the decode's operand words, docs/design/int4-branch.md);
    else a token a row; k's codes always a token a row. The write lays them so and
    ``v_from_cache`` undoes it."""
    w = d // 2
    assert v_layout.v_layout_applies(w, page) == (page % 16 == 0)
    rows, cols = v_layout.v_positions(torch.arange(page), w, page)
    pos = rows * w + cols  # [page, W] byte of each (token, column) in the page
    assert sorted(pos.flatten().tolist()) == list(range(page * w))  # a permutation
    if page % 16 == 0:
        word = pos.unflatten(0, (page // 4, 4))  # [token / 4, 4, W]
        assert torch.equal(word - word[:, :1], torch.arange(4)[None, :, None].expand_as(word))
        assert (word[:, 0] % 4 == 0).all()  # four tokens of a column: one aligned word
        lane = pos[::4].unflatten(1, (8, w // 32, 4))  # [token / 4, 8, W / 32, 4] words
        assert torch.equal(lane - lane[..., :1], 4 * torch.arange(4).expand_as(lane))
        assert (lane[..., 0] % 16 == 0).all()  # a lane's four words: 16 aligned bytes
    else:
        assert torch.equal(pos, torch.arange(page * w).view(page, w))
    kh, t = 2, page + 3  # a second page, partly filled
    cache = torch.zeros(2, 2, page, kh, d // 2, dtype=torch.uint8)
    scale = torch.zeros(2, 2, kh, page)
    x = torch.randn(t, kh, d)
    write_kv_per_token_head(cache, scale, x, x, torch.arange(t), "int4")
    packed, _ = quant.quantize_int4_rotated(x)
    flat = cache.transpose(0, 1).reshape(2, 2 * page, kh, d // 2)  # [k / v, slots, KH, D / 2]
    assert torch.equal(flat[0, :t], packed)  # k in token order
    offs = torch.arange(t)
    at, col = v_layout.v_positions(offs % page, w, page)  # [t, W]
    v_pages = cache[:, 1]  # [pages, page, KH, W]
    got = v_pages[(offs // page)[:, None, None], at[:, None], torch.arange(kh)[None, :, None],
                  col[:, None]]  # fmt: skip
    assert torch.equal(got, packed)  # v at its positions
    back = v_layout.v_from_cache(v_pages).reshape(2 * page, kh, w)
    assert torch.equal(back[:t], packed)
    assert torch.equal(v_layout.v_to_cache(back.view(2, page, kh, w)), v_pages)
