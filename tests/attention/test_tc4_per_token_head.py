"""``tc4_per_token_head`` (issue 33) on the CPU: k through the layer's calibrated basis P at
6 / 4 / 3 bits by the coordinates' weight, v's halves rotated at 5 / 4 bits, fp16 group scales
(math: ``attention/quant_tc.py``, test_quant_tc.py; the basis: ``attention/k_basis.py``). The
mode, its cache and bytes, the reference path against attention over the round-tripped k and v,
the basis leaving scores unchanged, its calibration, the fused ops (the passes' rewrite, compiled ==
eager bit for bit), tensor-parallel rows and the refusals."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from tests.support.attention import k_basis, opcheck
from tests.support.passes import (
    AttnQuantModel,
    check_compiled_equals_eager,
    make_batch,
    pages_for,
    qkv,
)
from torch_kvq.attention import (
    Attention,
    PageAllocator,
    ReferenceKernel,
    forward_context,
    quant_tc,
)
from torch_kvq.attention.k_basis import (
    BasisStats,
    basis_operand,
    basis_qk,
    group_rotation,
    inverse_transpose,
)
from torch_kvq.attention.memory import page_bytes
from torch_kvq.distributed import shard_specs
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig
from torch_kvq.spec_channels import KBasis
from torch_kvq.spec_modes import KVQuantMode, tc4_aux_width
from torch_kvq.spec_resolve import resolve_layer_specs

MODE = "tc4_per_token_head"
PAGE = 16  # tests.support.passes' PAGE_SIZE
_ids = itertools.count()  # live layers need distinct names


def specs(dtype: torch.dtype = torch.float32, n: int = 1, d: int = 32, **kw):
    tag = next(_ids)
    infos = [AttentionLayerInfo(f"tc{tag}.l{i}", 8, 2, d) for i in range(n)]
    cfg = KVCacheConfig(MODE, page_size=PAGE, k_bases=((0, k_basis(d=d)),), **kw)
    return resolve_layer_specs(cfg, infos, dtype)


def test_mode_spec_and_bytes() -> None:
    mode = KVQuantMode(MODE)
    assert mode.transform_coded and not mode.per_token_head and mode.code_dtype == torch.uint8
    assert (mode.cache_slots, mode.codes_per_byte) == (2, 2)
    has_scale = [m.value for m in KVQuantMode if m.has_kv_scale]
    assert has_scale == [m.value for m in KVQuantMode if m.per_token_head] + [MODE]
    info = AttentionLayerInfo("x", 8, 2, 128)
    (spec,) = resolve_layer_specs(
        KVCacheConfig(MODE, page_size=16, k_bases=(("x", k_basis(d=128)),)), [info]
    )
    # per kv head: k's 64 code bytes, v's 64, the side record's 24 (scales, zero points, a pad
    # byte, v's 5th bits)
    assert tc4_aux_width(128) == quant_tc.aux_width(128) == 24
    assert spec.cache_bytes_per_token == 2 * (64 + 64 + 24) == 2 * 152
    assert page_bytes(spec) == 16 * 304  # the memory planner counts codes plus side records
    assert spec.as_dict()["k_basis"] == spec.k_basis.label  # a digest, not the numbers


def test_layer_equals_attention_over_the_round_tripped_k_and_v() -> None:
    """The layer's cache holds quant_tc's codes of P k and of v at the batch's slots, and its
    output is, bit for bit, a model-dtype layer's given P^-T q and the round-tripped P k and v."""
    (spec,) = specs()
    (plain_spec,) = resolve_layer_specs(
        KVCacheConfig("auto", page_size=PAGE),
        [AttentionLayerInfo(f"plain{next(_ids)}", 8, 2, 32)],
        torch.float32,
    )
    plan = [(0, 5), (3, 1), (0, 2)]
    md, (q, k, v) = make_batch(plan, pages_for(plan)), qkv(8, (8, 2), 32, torch.float32)
    tc4, plain = Attention(spec, pages_for(plan)), Attention(plain_spec, pages_for(plan))
    assert tc4.kv_cache.shape == (pages_for(plan), 2, PAGE, 2, 16)
    assert tc4.kv_scale.dtype == torch.uint8 and tc4.kv_scale.shape[1:] == (2, 18, PAGE)
    p = spec.k_basis.matrix()
    assert torch.equal(tc4.k_basis, p)
    qb, kb = basis_qk(q, k, p, inverse_transpose(p))
    kc, ka = quant_tc.quantize_k(kb)
    vc, va = quant_tc.quantize_v(v)
    with torch.no_grad(), forward_context(md, (plain_spec,), ReferenceKernel()):
        want = plain(qb, quant_tc.dequantize_k(kc, ka), quant_tc.dequantize_v(vc, va))
    with torch.no_grad(), forward_context(md, (spec,), ReferenceKernel()):
        got = tc4(q, k, v)
    assert torch.equal(got, want)
    slots = md.slot_mapping
    pages, offs = slots // PAGE, slots % PAGE
    assert torch.equal(tc4.kv_cache[pages, 0, offs], kc)
    assert torch.equal(tc4.kv_cache[pages, 1, offs], vc)
    rows, cols = quant_tc.aux_positions(offs, quant_tc.aux_width(32), PAGE)
    heads = torch.arange(2)[None, :, None]
    got_aux = tc4.kv_scale[pages[:, None, None], heads, rows[:, None], cols[:, None]]
    assert torch.equal(got_aux, quant_tc.join_aux(ka, va))
    assert "k_basis=basis" in repr(tc4)


def test_the_basis_leaves_every_score_unchanged() -> None:
    """(P^-T q) . (P k) = q . k: only the cache sees other values."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(7, 8, 32, generator=g), torch.randn(7, 2, 32, generator=g)
    p = k_basis().matrix()
    qb, kb = basis_qk(q, k, p, inverse_transpose(p))  # fp32
    rep = lambda x: x.repeat_interleave(4, 1)  # noqa: E731  (query head h reads kv head h // 4)
    before = torch.einsum("thd,uhd->htu", q.double(), rep(k).double())
    after = torch.einsum("thd,uhd->htu", qb.double(), rep(kb).double())
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(kb, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_16_bit_basis_products_round_as_the_fp32_ones(dtype) -> None:
    """16-bit q and k take the basis in two matrices of their dtype (one product of twice the
    length, fp32 accumulation, one rounding): the fp32 products' result rounded to the dtype but
    in near-ties (here under 1% of the elements, each a last-bit difference of a value that the
    sum's order moves), and no further from the fp32 product than that rounding."""
    g = torch.Generator().manual_seed(2)
    p = torch.linalg.qr(torch.randn(2, 32, 32, generator=g))[0] * (
        torch.rand(2, 1, 32, generator=g) * 3 + 0.2
    )  # not orthogonal: P^-T != P
    q = (torch.randn(40, 8, 32, generator=g) * 3).to(dtype)
    k = (torch.randn(40, 2, 32, generator=g) * 3).to(dtype)
    pair, pair_inv_t = (basis_operand(m, dtype) for m in (p, inverse_transpose(p)))
    assert pair.shape == (2, 32, 64) and pair.dtype == dtype
    got = basis_qk(q, k, pair, pair_inv_t)
    exact = basis_qk(q.float(), k.float(), p, inverse_transpose(p))  # fp32 products, fp32 out
    for x, ref in zip(got, exact, strict=True):
        assert x.dtype == dtype
        rounded = ref.to(dtype)
        assert (x != rounded).float().mean() < 0.01
        err, floor = (x.float() - ref).norm(), (rounded.float() - ref).norm()
        assert err <= floor * 1.01, (err, floor)
    with pytest.raises(ValueError, match="basis pair is"):
        basis_qk(q.float(), k.float(), pair, pair_inv_t)


def test_calibrated_basis_sorts_the_weight_and_folds_the_group_rotations() -> None:
    """BasisStats' P = R T: T's coordinates have E[q'^2] = E[k'^2] = sigma, descending (the
    balanced basis), and R is orthogonal and block-diagonal over K's groups."""
    g = torch.Generator().manual_seed(2)
    mix = torch.randn(32, 32, generator=g) * torch.logspace(0, -2, 32)
    k = torch.randn(4096, 1, 32, generator=g) @ mix.T
    q = torch.randn(4096, 4, 32, generator=g) @ torch.randn(32, 32, generator=g).T
    stats = BasisStats()
    stats.add(q, k)
    p = stats.basis().matrix().double()[0]
    r = group_rotation(32)
    torch.testing.assert_close(r @ r.T, torch.eye(32, dtype=torch.float64))
    assert r[:8, 8:].abs().max() == 0 and r[16:, :16].abs().max() == 0
    t = r.T @ p
    kt = k[:, 0].double() @ t.T
    qt = q.reshape(-1, 32).double() @ torch.linalg.inv(t)  # P^-T q, rows
    ek, eq = kt.square().mean(0), qt.square().mean(0)
    # balanced (P is kept in fp32: the smallest coordinates only to 1e-3 of the largest)
    torch.testing.assert_close(ek, eq, rtol=1e-2, atol=1e-3 * float(ek.max()))
    assert (ek[:-1] >= ek[1:] * (1 - 1e-6)).all()  # sorted, largest first
    assert ek[:8].sum() > 4 * ek[16:].sum()  # the 6-bit quarter carries the weight here


def test_compiled_fuses_and_equals_eager_bit_for_bit() -> None:
    """A tc4 layer beside a bf16 one, compiled with the kvq passes: its write becomes
    ``kvq.quant_cache_write_tc`` and its read ``kvq.paged_attention_tc`` (the reference kernel
    reading the codes and side rows in place), and outputs, caches and side rows equal eager's
    bit for bit."""
    layers = specs(torch.bfloat16, n=2, skip_layers=(1,))
    plan = [(0, 5), (3, 1), (0, 2)]
    n = pages_for(plan)
    model = AttnQuantModel(layers, n)
    md, inputs = make_batch(plan, n), qkv(8, (8, 2), 32, torch.bfloat16)
    check_compiled_equals_eager(layers, model, md, inputs)


def test_fused_ops_equal_the_unfused_flow() -> None:
    """The fused write leaves the caches the unfused ops leave, and the fused attention returns
    the unfused read's attention, bit for bit (eager, outside any graph)."""
    (spec,) = specs()
    plan = [(0, 5), (3, 1), (0, 2)]
    md, (q, k, v) = make_batch(plan, pages_for(plan)), qkv(8, (8, 2), 32, torch.float32)
    a = Attention(spec, pages_for(plan))
    b_cache, b_scale = torch.zeros_like(a.kv_cache), torch.zeros_like(a.kv_scale)
    ops = torch.ops.kvq
    with torch.no_grad(), forward_context(md, (spec,), ReferenceKernel()):
        kc, ka = ops.quantize_tc(k, "k")
        vc, va = ops.quantize_tc(v, "v")
        ops.cache_write_tc(kc, vc, ka, va, a.kv_cache, a.kv_scale, spec.name)
        kv = ops.dequantize_kv_cache_tc(a.kv_cache, a.kv_scale, spec.name, torch.float32)
        want = ops.paged_attention(q, kv, spec.name)
        ops.quant_cache_write_tc(k, v, b_cache, b_scale, spec.name)
        got = ops.paged_attention_tc(q, b_cache, b_scale, spec.name)
    assert torch.equal(a.kv_cache, b_cache) and torch.equal(a.kv_scale, b_scale)
    assert b_scale.any()
    assert torch.equal(got, want)


def test_opcheck() -> None:
    """Every tc4 op's fake agrees with its real implementation (torch.library.opcheck)."""
    (spec,) = specs()
    plan = [(0, 5), (3, 1), (0, 2)]
    md, (q, k, v) = make_batch(plan, pages_for(plan)), qkv(8, (8, 2), 32, torch.float32)
    a = Attention(spec, pages_for(plan))
    ops = torch.ops.kvq
    with torch.no_grad(), forward_context(md, (spec,), ReferenceKernel()):
        kc, ka = ops.quantize_tc(k, "k")
        vc, va = ops.quantize_tc(v, "v")
        cache, side = a.kv_cache.clone(), a.kv_scale.clone()
        ops.cache_write_tc(kc, vc, ka, va, cache, side, spec.name)
        cases = [
            (ops.quantize_tc.default, (k, "k")),
            (ops.quantize_tc.default, (v, "v")),
            (ops.cache_write_tc.default, (kc, vc, ka, va, *_clones(a), spec.name)),
            (ops.dequantize_kv_cache_tc.default, (cache, side, spec.name, torch.float32)),
            (ops.quant_cache_write_tc.default, (k, v, *_clones(a), spec.name)),
            (ops.paged_attention_tc.default, (q, cache, side, spec.name)),
            (ops.basis_qk.default, (q, k, a.k_basis, a.k_basis_inv_t)),
        ]
        for op, args in cases:
            opcheck(op, args)


def _clones(a: Attention) -> tuple[torch.Tensor, torch.Tensor]:
    return a.kv_cache.clone(), a.kv_scale.clone()


def test_tensor_parallel_ranks_hold_their_heads_bases() -> None:
    from torch_kvq.distributed import TensorParallel

    (spec,) = specs()
    for rank in (0, 1):
        (mine,) = shard_specs((spec,), TensorParallel(rank, 2))
        assert mine.num_kv_heads == 1
        assert torch.equal(mine.k_basis.matrix()[0], spec.k_basis.matrix()[rank])


@pytest.mark.parametrize(
    ("cfg", "info", "match"),
    [
        (KVCacheConfig(MODE), AttentionLayerInfo("x", 8, 2, 32), "needs the layer's calibrated K"),
        (
            KVCacheConfig(MODE, k_bases=((0, k_basis(d=40)),)),
            AttentionLayerInfo("x", 8, 2, 40),
            "multiple of 16, got 40",
        ),
        (
            KVCacheConfig("int4_per_token_head", k_bases=((0, k_basis()),)),
            AttentionLayerInfo("x", 8, 2, 32),
            "tc4_per_token_head layers only",
        ),
        (
            KVCacheConfig(MODE, k_bases=((0, k_basis(kh=1)),)),
            AttentionLayerInfo("x", 8, 2, 32),
            r"is \(1, 32, 32\); expected",
        ),
    ],
)
def test_refusals(cfg, info, match) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_layer_specs(cfg, [info])


def test_torch_quant_form_is_refused() -> None:
    (spec,) = specs()
    with pytest.raises(ValueError, match="no torch-native quant form"):
        Attention(spec, 4, quant_form="torch")


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (torch.randn(2, 4, 5), r"\[num_kv_heads, D, D\]"),
        (torch.full((1, 2, 2), float("nan")), "finite"),
        ([[1.0]], "tensor"),
    ],
)
def test_basis_checks_its_values(value, match) -> None:
    with pytest.raises(ValueError, match=match):
        KBasis.of(value)


def test_config_checks_its_entries() -> None:
    with pytest.raises(ValueError, match="must be a KBasis"):
        KVCacheConfig(MODE, k_bases=((0, "basis"),))
    with pytest.raises(ValueError, match="more than once"):
        KVCacheConfig(MODE, k_bases=((0, k_basis()), (0, k_basis())))
    assert replace(KVCacheConfig(MODE), k_bases={0: k_basis()}).k_bases == ((0, k_basis()),)


HAS_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_the_math_on_cuda_writes_the_cpus_bytes() -> None:
    """tc4's write on a CUDA device (aten ops: products by Python floats, correctly rounded
    reciprocals and divisions, fp16 conversions) gives the CPU's code and side rows byte for
    byte, and the read the CPU's values, for Llama's and Gemma-3's head sizes."""
    g = torch.Generator().manual_seed(3)
    for d in (64, 128, 256):
        k, v = (torch.randn(8, 16, 2, d, generator=g) * 3 for _ in range(2))
        cpu = quant_tc.quantize_pages(k, v)
        gpu = quant_tc.quantize_pages(k.cuda(), v.cuda())
        for c, x in zip(cpu, gpu):
            assert torch.equal(x.cpu(), c), d
        assert torch.equal(quant_tc.dequantize_pages(*gpu).cpu(), quant_tc.dequantize_pages(*cpu))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_compiled_fuses_and_equals_eager_on_cuda() -> None:
    """The reference kernel on a CUDA device serves tc4 layers (no fused GPU kernel reads them
    yet): compiled with the passes, the fused write (the Triton program,
    ``kernels/kv_write_tc.py``) and read equal eager (aten's write) bit for bit, at head 64."""
    layers = specs(torch.bfloat16, n=2, d=64, skip_layers=(1,))
    plan = [(0, 5), (3, 1), (0, 2)]
    n = pages_for(plan)
    model = AttnQuantModel(layers, n).cuda()
    alloc = PageAllocator(n, PAGE)
    alloc.append_many([(1, 3)])  # the plan's past, as make_batch reserves it
    md = alloc.build_batch([(i, q) for i, (_, q) in enumerate(plan)], device="cuda")
    inputs = tuple(x.cuda() for x in qkv(8, (8, 2), 64, torch.bfloat16))
    check_compiled_equals_eager(layers, model, md, inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (and FlashInfer)")
@pytest.mark.parametrize("batch", ["prefill", "decode", "mixed"])
def test_flashinfer_kernel_matches_the_reference(batch: str) -> None:
    """FlashInferKernel on sm90 serves tc4 layers (a global one and a sliding one, head 128) in
    prefill and mixed batches by FlashInfer's prefill over the batch's pages dequantized (one
    Triton pass) and in decode batches by our TMA decode over the codes and side rows, within
    1e-2 (relative) of the reference kernel on the same codes and side rows. The decode gave
    a relative error of 1.36 here on an H200 (thirtieth session, refused then) until its fifth
    bits' MMA operand was fixed at 16-token pages (thirty-first)."""
    from torch_kvq.attention.kernels import FlashInferKernel
    from torch_kvq.attention.kernels.kv_write_tc import write_kv_tc

    plans = {
        "prefill": ({}, [(10, 40), (11, 130), (12, 17)]),
        "decode": ({0: 15, 1: 16, 2: 200, 3: 77}, [(0, 1), (1, 1), (2, 1), (3, 1)]),
        "mixed": ({0: 15, 1: 100}, [(0, 1), (1, 37), (5, 50)]),
    }
    hist, step = plans[batch]
    tag = next(_ids)
    infos = [AttentionLayerInfo(f"fi{tag}.g", 8, 2, 128),
             AttentionLayerInfo(f"fi{tag}.s", 8, 2, 128, sliding_window=64)]  # fmt: skip
    cfg = KVCacheConfig(MODE, page_size=16, k_bases={i: k_basis(d=128) for i in (0, 1)})
    layers = resolve_layer_specs(cfg, infos, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(len(batch))
    caches = {s.name: Attention(s, 64, device="cuda") for s in layers}
    alloc = PageAllocator(num_pages=64, page_size=16)
    mds = [alloc.build_batch(list(hist.items()), device="cuda")] if hist else []
    md = alloc.build_batch(step, device="cuda")
    for m in (*mds, md):
        for s in layers:
            k, v = (torch.randn(m.num_tokens, 2, 128, device="cuda", generator=g).bfloat16()
                    for _ in "kv")  # fmt: skip
            a = caches[s.name]
            write_kv_tc(a.kv_cache, a.kv_scale, k, v, m.for_window(s.sliding_window).slot_mapping)
    q = torch.randn(md.num_tokens, 8, 128, device="cuda", generator=g).bfloat16()
    outs = []
    for kernel in (ReferenceKernel(), FlashInferKernel()):
        with forward_context(md, list(layers), kernel) as ctx:
            outs.append([
                kernel.attend(ctx, s, q, caches[s.name].kv_cache, 1.0, 1.0, None,
                              caches[s.name].kv_scale)
                for s in layers
            ])  # fmt: skip
    for s, ref, got in zip(layers, *outs):
        err = float((got.float() - ref.float()).norm() / ref.float().norm())
        assert torch.isfinite(got).all() and err < 1e-2, (batch, s.name, err)
