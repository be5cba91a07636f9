"""``k8v4_per_token_head`` (issue 33) on the CPU: k as ``int8_per_token_head``, v as
``int4_per_token_head`` in one uint8 cache [pages, 3, page, KH, D / 2]. The mode, its cache and
bytes, the write and read of the reference path (eager and fused, bit for bit), a per-layer map
mixing it with int4, int8 and bf16 layers on a small model, FlashInfer's capability rows (sm90
only), and the refusals (odd head size, the torch-native quant form, FlashInfer off sm90). The
GPU programs' tests: tests/attention/test_kv_write_int4.py (write),
triton_programs/test_kv_dequant.py (scratch), triton_programs/test_triton_decode_k8v4.py
(decode)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests.support.attention import opcheck, per_token_head_case
from tests.support.passes import (
    AttnQuantModel,
    check_layer0_fuses_and_equals_eager,
    make_batch,
    make_specs,
    pages_for,
    qkv,
)
from torch_kvq.attention import Attention, ReferenceKernel, forward_context, quant, v_layout
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
MODE = "k8v4_per_token_head"


def k_round_trip(x: torch.Tensor) -> torch.Tensor:
    """int8_per_token_head's round trip (quant.py), fp32."""
    return quant.dequantize_per_token_head(*quant.quantize_per_token_head(x, "int8"))


def v_round_trip(x: torch.Tensor) -> torch.Tensor:
    """int4_per_token_head's round trip (quant.py), fp32."""
    return quant.dequantize_int4_rotated(*quant.quantize_int4_rotated(x))


@pytest.fixture
def setup():
    with per_token_head_case(MODE) as case:
        yield case


def test_mode_spec_and_bytes() -> None:
    mode = KVQuantMode(MODE)
    assert mode.per_token_head and mode.code_dtype == torch.uint8 and mode.cache_slots == 3
    assert (mode.per_token_head_format, mode.k_format, mode.v_format) == ("k8v4", "int8", "int4")
    assert (
        quant.kv_formats("k8v4") == ("int8", "int4") and quant.kv_formats("int4") == ("int4",) * 2
    )
    assert KVQuantMode.INT4_PER_TOKEN_HEAD.cache_slots == 2
    (spec,) = resolve_layer_specs(
        KVCacheConfig(MODE, page_size=16), [AttentionLayerInfo("x", 8, 2, 128)]
    )
    assert spec.code_dim == 64
    # per kv head: k's 128 int8 codes, v's 64 bytes of int4 codes, two 4-byte scales
    assert spec.cache_bytes_per_token == 2 * (128 + 64 + 8) == 400
    assert spec.scale_bytes_per_token == 16
    assert page_bytes(spec) == 16 * 400  # the memory planner counts codes plus scales


def test_layer_allocates_three_slots_and_scales(setup) -> None:
    (skip, pth), (a_skip, a), *_ = setup
    assert a_skip.kv_scale is None and a_skip.kv_cache.shape[-1] == 32
    assert a.kv_cache.dtype == torch.uint8 == pth.storage_dtype
    assert tuple(a.kv_cache.shape) == (8, 3, 4, 2, 16)  # pages, k lo / k hi / v, page, KH, D / 2
    assert a.kv_scale.dtype == torch.float32 and tuple(a.kv_scale.shape) == (8, 2, 2, 4)
    assert a.kv_cache.nbytes + a.kv_scale.nbytes == 8 * page_bytes(pth)


def test_write_then_read_is_int8_for_k_and_int4_for_v(setup) -> None:
    """The layer's write then the unfused read give, per token, exactly int8's round trip of k
    and int4's of v; the cache holds k's int8 codes in slots 0 / 1, v's packed codes in slot 2."""
    (_, pth), (_, a), q, k, v, md = setup
    a(q, k, v)
    kv = ops.dequantize_kv_cache_per_token_head(a.kv_cache, a.kv_scale, pth.name, torch.float32)
    assert kv.shape == (8, 2, 4, 2, 32)
    slots = md.slot_mapping.long()
    pages, offs = slots // 4, slots % 4
    assert torch.equal(kv[pages, 0, offs], k_round_trip(k))
    assert torch.equal(kv[pages, 1, offs], v_round_trip(v))
    kc, ks = quant.quantize_per_token_head(k, "int8")
    # k's codes offset binary (code + 128, the sign bit flipped) over slots 0 and 1
    assert torch.equal((a.kv_cache[pages, 0, offs] ^ 0x80).view(torch.int8), kc[..., :16])
    assert torch.equal((a.kv_cache[pages, 1, offs] ^ 0x80).view(torch.int8), kc[..., 16:])
    assert torch.equal(a.kv_scale[pages, 0, :, offs], ks)
    vc, vs = quant.quantize_int4_rotated(v)
    assert torch.equal(v_layout.v_from_cache(a.kv_cache[:, 2])[pages, offs], vc)  # v's layout
    assert torch.equal(a.kv_scale[pages, 1, :, offs], vs)
    # the int8 k is far closer to k than int4 would be
    assert (kv[pages, 0, offs] - k.float()).abs().max() < 0.02 * k.float().abs().max()


def test_k_slots_round_trip() -> None:
    codes = torch.randint(-128, 128, (5, 3, 64), dtype=torch.int8)
    slots = quant.k8v4_k_slots(codes)
    assert slots.shape == (5, 2, 3, 32) and slots.dtype == torch.uint8
    # offset binary: the byte is code + 128 (-128 -> 0, 0 -> 128, 127 -> 255)
    assert torch.equal(slots[:, 0, :, 0].long(), codes[..., 0].long() + 128)
    # as pages [n, 2, page, KH, D / 2]: one page of 5 tokens
    assert torch.equal(quant.k8v4_k_codes(slots.movedim(0, 1).unsqueeze(0))[0], codes)


def test_quantize_k8v4_pages_is_the_writes_layout() -> None:
    """``quant.quantize_k8v4_pages`` (the GPU tests' and benchmarks' caches) holds what the aten
    write puts in a k8v4 cache, token for token."""
    x = torch.randn(2, 2, 4, 2, 32).bfloat16()
    codes, scales = quant.quantize_k8v4_pages(x)
    cache, scale = torch.zeros(2, 3, 4, 2, 16, dtype=torch.uint8), torch.zeros(2, 2, 2, 4)
    k, v = x[:, 0].reshape(8, 2, 32), x[:, 1].reshape(8, 2, 32)
    write_kv_per_token_head(cache, scale, k, v, torch.arange(8), "k8v4")
    assert torch.equal(codes, cache) and torch.equal(scales, scale.transpose(-1, -2))


@pytest.mark.parametrize("rounding", ["half_away", "half_even"])
def test_fused_write_equals_quantize_then_write(setup, rounding) -> None:
    (_, pth), (_, a), _, k, v, _ = setup
    c1, s1 = a.kv_cache.clone(), a.kv_scale.clone()
    c2, s2 = a.kv_cache.clone(), a.kv_scale.clone()
    kc, ks = ops.quantize_per_token_head(k, "int8")
    vc, vs = ops.quantize_per_token_head(v, "int4")
    if rounding == "half_even":  # the fused write told to round k as torch.round does
        kc, ks = quant.quantize_per_token_head(k, "int8", "half_even")
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

    # attention over the dequantized fp32 k (int8) and v (int4): the same output, bit for bit
    rt = ops.paged_attention(q, cache_of(k_round_trip(k), v_round_trip(v)), pth.name)
    assert torch.equal(fused, rt)
    exact = ops.paged_attention(q, cache_of(k.float(), v.float()), pth.name).float()
    assert (fused.float() - exact).abs().mean() < 0.1 * exact.abs().mean()


def test_opcheck_every_op(setup) -> None:
    (_, pth), (_, a), q, k, v, _ = setup
    kc, ks = ops.quantize_per_token_head(k, "int8")
    vc, vs = ops.quantize_per_token_head(v, "int4")
    cache, scale = a.kv_cache.clone(), a.kv_scale.clone()
    ops.quant_cache_write_per_token_head(k, v, cache, scale, pth.name, "half_away")
    cases = [
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


def test_ops_check_each_sides_codes_and_the_cache(setup) -> None:
    (_, pth), (_, a), q, k, v, _ = setup
    kc, ks = ops.quantize_per_token_head(k, "int8")
    vc, vs = ops.quantize_per_token_head(v, "int4")
    with pytest.raises(ValueError, match=r"k has dtype torch.uint8, expected torch.int8"):
        ops.cache_write_per_token_head(
            kc.view(torch.uint8), vc, ks, vs, a.kv_cache, a.kv_scale, pth.name
        )
    with pytest.raises(ValueError, match=r"v has shape \(9, 2, 32\), expected \(9, 2, 16\)"):
        ops.cache_write_per_token_head(kc, kc, ks, vs, a.kv_cache, a.kv_scale, pth.name)
    two_slots = torch.zeros(8, 2, 4, 2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"kv_cache has shape \(8, 2, 4, 2, 16\), expected "):
        ops.paged_attention_per_token_head(q, two_slots, a.kv_scale, pth.name)
    with pytest.raises(ValueError, match=r"mode 'k8v4' needs torch.uint8 \[pages, 3, page, KH"):
        write_kv_per_token_head(
            two_slots, a.kv_scale, k, v, torch.zeros(9, dtype=torch.long), "k8v4"
        )
    with pytest.raises(ValueError, match=r"unknown per-\(token, head\) format 'k8v4'"):
        ops.quantize_per_token_head(k, "k8v4")


def test_compiled_fuses_and_equals_eager_bit_for_bit() -> None:
    check_layer0_fuses_and_equals_eager(make_specs(2, MODE, skip=(1,)))


def test_a_map_mixing_k8v4_int4_int8_and_bf16_runs_eagerly() -> None:
    """llama-tiny (random weights, 4 layers, head 32): layer 0 k8v4, 1 int4, 2 int8, 3 bf16; each
    layer's cache has its own dtype and shape, each is written, and the run generates."""
    cfg = KVCacheConfig(
        "auto",
        layer_modes=((0, MODE), (1, "int4_per_token_head"), (2, "int8_per_token_head")),
        page_size=4,
    )
    model = build_model("llama-tiny", cfg, num_pages=16)
    got = [
        (a.spec.mode.value, a.kv_cache.dtype, tuple(a.kv_cache.shape[1:]))
        for a in model.attention_layers
    ]
    assert got == [
        (MODE, torch.uint8, (3, 4, 2, 16)),
        ("int4_per_token_head", torch.uint8, (2, 4, 2, 16)),
        ("int8_per_token_head", torch.int8, (2, 4, 2, 32)),
        ("none", torch.bfloat16, (2, 4, 2, 32)),
    ]
    assert [a.kv_scale is not None for a in model.attention_layers] == [True, True, True, False]
    # per token, 2 kv heads: k8v4 2 x (32 + 16 + 8), int4 2 x (16 + 16 + 8), int8 2 x (64 + 8)
    assert [s.cache_bytes_per_token for s in model.kv_specs] == [112, 80, 144, 256]
    prompts = [[1, 5, 9, 14, 3, 7, 2, 11, 30, 4, 6], [8, 2, 4]]
    out = generate(model, prompts, 3)
    assert [len(t) for t in out.tokens] == [3, 3] and torch.isfinite(out.logits).all()
    for a in model.attention_layers:
        assert a.kv_cache.view(torch.uint8).any()
        assert a.kv_scale is None or a.kv_scale.any()
    bf16 = generate(build_model("llama-tiny", KVCacheConfig(page_size=4), num_pages=16), prompts, 3,
                    force_tokens=out.tokens)  # fmt: skip
    torch.testing.assert_close(out.logits, bf16.logits, atol=0.5, rtol=0.0)


# -- refusals ------------------------------------------------------------------------------------


def test_odd_head_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"layer 0 \('x'\): mode 'k8v4_per_token_head' packs two "
                       r"4-bit codes per byte, so its head size must be even, got 15"):  # fmt: skip
        resolve_layer_specs(KVCacheConfig(MODE), [AttentionLayerInfo("x", 4, 2, 15)])
    (spec,) = resolve_layer_specs(KVCacheConfig(MODE), [AttentionLayerInfo("y", 4, 2, 96)])
    assert spec.code_dim == 48 and spec.cache_bytes_per_token == 2 * (96 + 48 + 8)


def test_torch_quant_form_is_refused() -> None:
    (spec,) = make_specs(1, MODE)
    with pytest.raises(ValueError, match=r"has no torch-native quant form .* use quant_form='op'"):
        Attention(spec, 4, quant_form="torch")


@pytest.mark.parametrize("name", [n for n in caps.known_kernels() if n.startswith("flashinfer")])
def test_flashinfer_rows_list_k8v4_on_sm90_only(name: str) -> None:
    """Every FlashInfer configuration serves the mode on sm90 (decode on the Triton program,
    prefill on the scratch), so the passes fuse its write and read there; elsewhere no row lists
    it and nothing is fused. The reference kernel serves it everywhere."""
    (spec,) = resolve_layer_specs(
        KVCacheConfig(MODE, page_size=16), [AttentionLayerInfo("fi.attn", 8, 2, 128)]
    )
    assert caps.unsupported_reason(name, "sm90", spec) is None
    assert make_stamp(spec, name, "sm90").kv_in_place
    for arch in ("sm80", "sm89", "sm100"):
        why = caps.unsupported_reason(name, arch, spec)
        assert why is not None and why.startswith("quant mode 'k8v4_per_token_head' is not")
        assert not make_stamp(spec, name, arch).kv_in_place
    assert caps.unsupported_reason("reference", "sm90", spec) is None
    assert make_stamp(spec, "reference", "cpu").kv_in_place


def test_compiles_with_flashinfer_on_sm90_fusing_both(monkeypatch) -> None:
    """k8v4 layers compile with ``kernel="flashinfer"`` on sm90 (pretended; the graph runs on
    the CPU with the reference kernel): the write and the read are fused, as for int4."""
    from torch_kvq import make_kvq_backend

    monkeypatch.setattr(caps, "device_arch", lambda device: "sm90")
    plan = [(0, 5), (3, 1)]
    specs = make_specs(2, MODE, skip=(1,), head_size=64)
    n = pages_for(plan)
    model = AttnQuantModel(specs, n)
    md, inputs = make_batch(plan, n), qkv(6, (8, 2), 64, torch.bfloat16)
    backend = make_kvq_backend(inner="eager", kernel="flashinfer")
    torch._dynamo.reset()
    with torch.no_grad(), forward_context(md, specs, ReferenceKernel()):
        torch.compile(model, backend=backend)(*inputs)
    rep = backend.managers[-1].last
    assert {info["kernel"] for info in rep.layers.values()} == {"flashinfer"}
    assert rep.fused(specs[0].name) == ("quant+write", "dequant+attn")


@pytest.mark.parametrize("cc", [(9, 0), (8, 9)])
def test_flashinfer_kernel_checks_k8v4_by_arch(cc: tuple[int, int]) -> None:
    """sm90: served (where Triton is installed: the decode and the scratch are its programs);
    sm89: refused, naming the layer and the mode."""
    import importlib.util

    (spec,) = resolve_layer_specs(
        KVCacheConfig(MODE, page_size=16), [AttentionLayerInfo("fi.attn", 8, 2, 128)]
    )
    with (
        mock.patch.object(torch.cuda, "is_available", return_value=True),
        mock.patch.object(torch.cuda, "get_device_capability", return_value=cc),
    ):
        if cc == (9, 0) and importlib.util.find_spec("triton") is not None:
            FlashInferKernel().check_supported(spec)
            return
        want = "needs Triton" if cc == (9, 0) else "quant mode 'k8v4_per_token_head' is not"
        with pytest.raises(KernelUnsupportedError, match=rf"layer 'fi.attn': .* {want}"):
            FlashInferKernel().check_supported(spec)


def test_cpu_write_of_k8v4_is_the_aten_form() -> None:
    cache = torch.zeros(2, 3, 4, 2, 16, dtype=torch.uint8)
    scale = torch.zeros(2, 2, 2, 4)
    k = torch.randn(3, 2, 32)
    v = torch.randn(3, 2, 32)
    write_kv_per_token_head(cache, scale, k, v, torch.tensor([0, 1, 2]), "k8v4")
    kc, ks = quant.quantize_per_token_head(k, "int8")
    vc, vs = quant.quantize_int4_rotated(v)
    assert torch.equal(cache[0, :2, :3], quant.k8v4_k_slots(kc).movedim(0, 1))
    assert torch.equal(v_layout.v_from_cache(cache[0, 2])[:3], vc)  # v: its layout
    assert torch.equal(scale[0, 0, :, :3], ks.T) and torch.equal(scale[0, 1, :, :3], vs.T)
