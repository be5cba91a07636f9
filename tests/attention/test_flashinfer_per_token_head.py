"""FlashInferKernel on per-(token, head) layers (int8 / e4m3 codes, or int4 ones two per byte, or
k int8 and v int4 (k8v4), with fp32 scales, ``kv_scale``).

CPU: the capability rows (sm90 only, every configuration; page sizes), which variant serves each
phase, the argument checks, the fp32 -> model-dtype copy of the unfused form's pages. GPU (``-m
gpu``): decode on the Triton kernel and prefill / mixed batches on the compact dequantized
scratch (fa2 and fa3) against the reference kernel on the fp32 dequantized cache, the unfused
form's fp32 cache, and CUDA-graph replay of the decode.
"""

from __future__ import annotations

import pytest
import torch

from torch_kvq.attention import PageAllocator, ReferenceKernel, forward_context
from torch_kvq.attention.kernels import FlashInferKernel
from torch_kvq.attention.kernels import capabilities as caps
from torch_kvq.attention.kernels.flashinfer_support import check_kv_scale
from torch_kvq.attention.kernels.kv_dequant import batch_pages_as
from torch_kvq.attention.quant import dequantize_pages_per_token_head
from torch_kvq.spec import LayerKVSpec
from torch_kvq.spec_modes import FP8_DTYPE, KVQuantMode

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (and FlashInfer)")
INT8, FP8 = KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD
INT4, K8V4 = KVQuantMode.INT4_PER_TOKEN_HEAD, KVQuantMode.K8V4_PER_TOKEN_HEAD
CODE = {INT8: torch.int8, FP8: FP8_DTYPE, INT4: torch.uint8, K8V4: torch.uint8,
        KVQuantMode.NONE: torch.bfloat16}  # fmt: skip
PAGE, D, WINDOW, SOFT_CAP, PAGES = 16, 128, 64, 5.0, 64
FI_NAMES = ("flashinfer", "flashinfer-xqa", "flashinfer-decode", "flashinfer-xqa-decode",
            "flashinfer-triton", "flashinfer-triton-decode")  # fmt: skip
TOL = 1e-2  # relative Frobenius error, as the bf16 / FP8 paths' (test_flashinfer_kernel.py)


def spec(name: str, mode: KVQuantMode, index: int = 0, **kw) -> LayerKVSpec:
    kw = {"num_heads": 8, "num_kv_heads": 2, "head_size": D, "page_size": PAGE, **kw}
    return LayerKVSpec(name, index, mode, CODE[mode], torch.bfloat16, **kw)


def _kernel(name: str) -> FlashInferKernel:
    fp8_decode = "xqa" if "xqa" in name else "triton" if "triton" in name else "tensor_cores"
    kernel = FlashInferKernel(fp8_decode, phases="decode" if name.endswith("decode") else "any")
    assert kernel.name == name
    return kernel


# -- CPU: capability rows, variants, checks -------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm80", "sm89", "sm90", "sm100", "sm120"])
@pytest.mark.parametrize("mode", [INT8, FP8, INT4, K8V4])
def test_rows_claim_sm90_only(arch: str, mode: KVQuantMode) -> None:
    layers = [spec("t.g", mode), spec("t.cap", mode, sliding_window=WINDOW, logits_soft_cap=5.0)]
    for name in FI_NAMES:
        for s in layers:
            why = caps.unsupported_reason(name, arch, s)
            if arch == "sm90":
                assert why is None, (name, s.name, why)
            else:
                assert why is not None and f"quant mode {mode.value!r} is not supported" in why
        for dtype in (torch.bfloat16, torch.float16):
            assert caps.supports(name, arch, mode, dtype, False) is (arch == "sm90")
            assert not caps.supports(name, arch, mode, dtype, True)  # never FP8 output
        assert not caps.supports(name, arch, mode, torch.float32, False)


def test_page_size_limits_are_the_triton_decodes() -> None:
    for name in FI_NAMES:
        for page in (16, 32, 64):
            assert caps.unsupported_reason(name, "sm90", spec("t", INT8, page_size=page)) is None
        for page in (8, 128):
            assert caps.unsupported_reason(name, "sm90", spec("t", FP8, page_size=page)) == (
                f"page size {page} is not supported for fp8_per_token_head caches; expected one "
                "of (16, 32, 64)"
            )
    # FP8 per-tensor limits stay on FP8 per-tensor layers: XQA's soft-cap refusal is not theirs
    cap = spec("t.cap", INT8, logits_soft_cap=5.0)
    assert caps.unsupported_reason("flashinfer-xqa", "sm90", cap) is None
    assert caps.unsupported_reason("flashinfer", "sm90", spec("t", INT8, head_size=96)) == (
        "head size 96 is not supported; expected one of (64, 128, 256)"
    )


def test_kernel_check_is_the_table_and_names_the_layer(monkeypatch) -> None:
    import importlib.util

    from torch_kvq.attention.kernels import KernelUnsupportedError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    has_triton = importlib.util.find_spec("triton") is not None
    for arch, cc in (("sm90", (9, 0)), ("sm80", (8, 0))):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, cc=cc: cc)
        for name in FI_NAMES:
            kernel = _kernel(name)
            s = spec("m.layers.3.attn", INT8)
            if arch == "sm90" and has_triton:
                kernel.check_supported(s)
                continue
            with pytest.raises(KernelUnsupportedError, match=r"layer 'm.layers.3.attn'") as e:
                kernel.check_supported(s)
            want = "need" if arch == "sm90" else "quant mode 'int8_per_token_head' is not supported"
            assert want in str(e.value), str(e.value)


@pytest.mark.parametrize("prefill,want", [("fa2", "fa2"), ("fa3", "fa3"), ("fa3_fp8", "fa3")])
@pytest.mark.parametrize("fp8_decode", ["tensor_cores", "xqa", "triton"])
def test_variants_and_group_keys(prefill: str, want: str, fp8_decode: str) -> None:
    """Codes decode on the Triton kernel whatever ``fp8_decode`` says (fp16 math by default),
    prefill on the compact model-dtype scratch; the unfused form (model-dtype cache) on the
    model-dtype kernels, never the Triton one."""
    for mode in (INT8, FP8, INT4, K8V4):
        s = spec("t", mode)
        kernel = FlashInferKernel(fp8_decode, prefill=prefill)
        assert kernel.variant(s, "decode") == "triton-decode"
        assert kernel.variant(s, "prefill") == f"{want}-compact-prefill"
        assert kernel.variant(s, "decode", torch.bfloat16) == "tc-decode"
        dec = kernel._group_key(s, s.storage_dtype, decode=True)
        assert (dec.kernel, dec.kv_dtype, dec.q_dtype) == ("triton", CODE[mode], torch.float16)
        pre = kernel._group_key(s, s.storage_dtype, decode=False)
        assert (pre.kernel, pre.backend) == ("compact-prefill", want)
        assert pre.kv_dtype == pre.q_dtype == torch.bfloat16
        unfused = kernel._group_key(s, torch.bfloat16, decode=False)
        assert unfused.kernel == "prefill" and unfused != pre  # its own plan: another table
        model = FlashInferKernel(fp8_decode, prefill=prefill, fp8_decode_math="model")
        assert model._group_key(s, s.storage_dtype, decode=True).q_dtype == torch.bfloat16


def test_check_kv_scale() -> None:
    s, f = spec("m.l0", INT8), spec("m.l1", KVQuantMode.NONE)
    codes, scales = torch.zeros(2, 2, 16, 2, 8, dtype=torch.int8), torch.ones(2, 2, 2, 16)
    check_kv_scale(s, codes, scales, 1.0, 1.0)
    check_kv_scale(s, codes.float(), None, 1.0, 1.0)  # the unfused form's dequantized cache
    check_kv_scale(f, codes.bfloat16(), None, 0.5, 1.0)
    with pytest.raises(ValueError, match=r"layer 'm.l0' \(int8_per_token_head\).*kv_scale is None"):
        check_kv_scale(s, codes, None, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"'m.l0'.*k_scale=0.5, v_scale=1.0.*must be 1.0"):
        check_kv_scale(s, codes, scales, 0.5, 1.0)
    with pytest.raises(ValueError, match=r"'m.l1' \(none\): kv_scale given with a torch.bfloat16"):
        check_kv_scale(f, codes.bfloat16(), scales, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"'m.l0'.*kv_scale given with a torch.float32 cache"):
        check_kv_scale(s, codes.float(), scales, 1.0, 1.0)


def test_batch_pages_as_copies_only_the_batch_pages() -> None:
    cache = torch.randn(6, 2, 4, 2, 8)
    ids = torch.tensor([4, 1, 4], dtype=torch.int32)  # a page shared by two sequences
    out = batch_pages_as(cache, ids, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == cache.shape
    assert torch.equal(out[[1, 4]], cache[[1, 4]].bfloat16())


# -- GPU: against the reference on the fp32 dequantized cache ------------------------------------

# (history {seq: kv tokens already cached}, step [(seq, new tokens)]), as test_flashinfer_kernel.py
BATCHES = {
    "prefill": ({}, [(10, 40), (11, 130), (12, 17)]),
    "decode": ({0: 15, 1: 16, 2: 200, 3: 77}, [(0, 1), (1, 1), (2, 1), (3, 1)]),
    "mixed": ({0: 15, 1: 100}, [(0, 1), (1, 37), (5, 50)]),
    "long": ({}, [(20, 600), (21, 300)]),
}
LAYERS = [
    spec("p.g_int8", INT8, 0),
    spec("p.s_fp8", FP8, 1, sliding_window=WINDOW),
    spec("p.g_fp8", FP8, 2, sm_scale=0.05),
    spec("p.s_int8", INT8, 3, sliding_window=WINDOW),
    spec("p.g_bf16", KVQuantMode.NONE, 4),
    spec("p.g_int4", INT4, 5),
    spec("p.s_int4", INT4, 6, sliding_window=WINDOW),
    spec("p.g_k8v4", K8V4, 7),
    spec("p.s_k8v4", K8V4, 8, sliding_window=WINDOW),
]
CAPPED = [spec("c.s_int8_cap", INT8, 0, sliding_window=WINDOW, logits_soft_cap=SOFT_CAP),
          spec("c.g_fp8_cap", FP8, 1, logits_soft_cap=SOFT_CAP),
          spec("c.g_int4_cap", INT4, 2, logits_soft_cap=SOFT_CAP),
          spec("c.s_k8v4_cap", K8V4, 3, sliding_window=WINDOW, logits_soft_cap=SOFT_CAP)]  # fmt: skip


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


class Scenario:
    """Poisoned per-(token, head) caches (finite codes, positive scales everywhere), a history
    written through the fused write, one step's batch written the same way, and queries."""

    def __init__(self, specs: list[LayerKVSpec], batch: str, seed: int = 0) -> None:
        from torch_kvq.attention.kernels.kv_write_per_token_head import write_kv_per_token_head

        g = torch.Generator(device="cuda").manual_seed(seed)
        self.specs, self.caches, self.scales = specs, {}, {}
        for s in specs:
            shape = (PAGES, s.mode.cache_slots, PAGE, s.num_kv_heads, s.code_dim)
            if s.storage_dtype == torch.uint8:  # int4: any byte is two valid codes (k8v4 too)
                poison = torch.randint(0, 256, shape, device="cuda", generator=g)
            else:
                poison = torch.randn(shape, device="cuda", generator=g) * 4
            self.caches[s.name] = poison.to(s.storage_dtype)
            if s.mode.per_token_head:
                sc = torch.rand(PAGES, 2, s.num_kv_heads, PAGE, device="cuda", generator=g) + 0.5
                self.scales[s.name] = sc / 32
        alloc = PageAllocator(num_pages=PAGES, page_size=PAGE)
        hist, step = BATCHES[batch]
        mds = [alloc.build_batch(list(hist.items()), device="cuda")] if hist else []
        self.md = alloc.build_batch(step, device="cuda")
        for md in (*mds, self.md):
            for s in specs:
                k, v = (
                    torch.randn(md.num_tokens, s.num_kv_heads, D, device="cuda", generator=g)
                    .mul(3.0 if s.index % 2 else 0.3)
                    .bfloat16()
                    for _ in "kv"
                )
                cache = self.caches[s.name]
                if s.mode.per_token_head:
                    mode = s.mode.per_token_head_format
                    slots = md.for_window(s.sliding_window).slot_mapping
                    write_kv_per_token_head(cache, self.scales[s.name], k, v, slots, mode)
                else:
                    with forward_context(md, [s], ReferenceKernel()):
                        torch.ops.kvq.cache_write(k, v, cache, s.name)
        self.q = {
            s.name: torch.randn(self.md.num_tokens, s.num_heads, D, device="cuda", generator=g)
            .mul(2)
            .bfloat16()
            for s in specs
        }

    def fp32_cache(self, s: LayerKVSpec) -> torch.Tensor:
        if not s.mode.per_token_head:
            return self.caches[s.name].float()
        ids = torch.arange(PAGES, device="cuda")
        return dequantize_pages_per_token_head(
            self.caches[s.name], self.scales[s.name], ids, torch.float32
        )

    def reference(self) -> dict[str, torch.Tensor]:
        """The reference kernel on the fp32 dequantized caches (the modes' semantics)."""
        with forward_context(self.md, self.specs, ReferenceKernel()) as ctx:
            return {
                s.name: ReferenceKernel().attend(
                    ctx, s, self.q[s.name], self.fp32_cache(s), 1.0, 1.0, None
                )
                for s in self.specs
            }

    def attend(self, kernel: FlashInferKernel, unfused: bool = False) -> dict[str, torch.Tensor]:
        """``kernel.attend`` on the codes and their scales (``unfused``: on the fp32 caches)."""
        out = {}
        with forward_context(self.md, self.specs, kernel) as ctx:
            for s in self.specs:
                cache, kv_scale = self.caches[s.name], self.scales.get(s.name)
                if unfused and s.is_quantized:
                    cache, kv_scale = self.fp32_cache(s), None
                q = self.q[s.name]
                out[s.name] = kernel.attend(ctx, s, q, cache, 1.0, 1.0, None, kv_scale)
        return out


@pytest.fixture(scope="module")
def built() -> None:
    """The FlashInfer modules these tests use, compiled in parallel."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    from torch_kvq.attention.kernels import flashinfer_jit as jit

    mods = {}
    for kernel in (FlashInferKernel(), FlashInferKernel(prefill="fa3")):
        mods.update(jit.jit_specs(kernel, LAYERS))
    jit.build(mods, max_workers=len(mods))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("prefill", ["fa2", "fa3"])
def test_kernel_matches_reference(built, batch: str, prefill: str) -> None:
    sc = Scenario(LAYERS, batch, seed=len(batch))
    ref = sc.reference()
    kernel = FlashInferKernel(unfused_attention=False, prefill=prefill)
    out = sc.attend(kernel)
    for s in LAYERS:
        o = out[s.name]
        assert o.dtype == torch.bfloat16 and o.shape == ref[s.name].shape, s.name
        assert torch.isfinite(o).all(), s.name
        err = rel_err(o, ref[s.name])
        assert err < TOL, f"{batch} {prefill} {s.name}: rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("math", ["fp16", "model"])
@pytest.mark.parametrize("fp8_decode", ["tensor_cores", "xqa"])
def test_decode_with_soft_cap_on_any_configuration(fp8_decode: str, math: str) -> None:
    """Soft-capped layers decode on the Triton kernel in the XQA configuration too (XQA's
    no-soft-cap limit is an FP8 per-tensor one), in fp16 and in model-dtype math."""
    sc = Scenario(CAPPED, "decode", seed=7)
    ref = sc.reference()
    kernel = FlashInferKernel(fp8_decode, unfused_attention=False, fp8_decode_math=math)
    out = sc.attend(kernel)
    for s in CAPPED:
        err = rel_err(out[s.name], ref[s.name])
        assert err < TOL, f"{s.name}: rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_unfused_form_casts_fp32_pages(built, batch: str) -> None:
    """The unfused form hands attend the fp32 dequantized cache: cast to bf16 on the batch's
    pages, then the model-dtype plan; without ``unfused_attention`` there is no such plan."""
    from torch_kvq.attention.kernels import KernelUnsupportedError

    sc = Scenario(LAYERS, batch, seed=3)
    ref = sc.reference()
    out = sc.attend(FlashInferKernel(unfused_attention=True), unfused=True)
    for s in LAYERS:
        err = rel_err(out[s.name], ref[s.name])
        assert err < TOL, f"{batch} {s.name}: rel err {err:.2e}"
    with pytest.raises(KernelUnsupportedError, match="unfused_attention=True"):
        sc.attend(FlashInferKernel(unfused_attention=False), unfused=True)


@pytest.mark.gpu
@needs_gpu
def test_missing_or_stray_scales_are_refused() -> None:
    sc = Scenario(LAYERS[:1], "decode")
    s = LAYERS[0]
    kernel = FlashInferKernel(unfused_attention=False)
    with forward_context(sc.md, sc.specs, kernel) as ctx:
        with pytest.raises(ValueError, match=r"'p.g_int8'.*kv_scale is None"):
            kernel.attend(ctx, s, sc.q[s.name], sc.caches[s.name], 1.0, 1.0, None)
        with pytest.raises(ValueError, match=r"must be 1.0"):
            kernel.attend(
                ctx, s, sc.q[s.name], sc.caches[s.name], 2.0, 1.0, None, sc.scales[s.name]
            )


@pytest.mark.gpu
@needs_gpu
def test_decode_graph_replay_reads_the_scales_from_the_device() -> None:
    """Planned for a graph shape (fixed block-table buffers) and captured once: replays after
    re-planning that shape, with the scales changed in their buffers, equal the uncaptured
    kernel (new lengths under replay: test_triton_decode_per_token_head.py, and the graph runner)."""
    from torch_kvq.attention.metadata import GraphShape

    specs = LAYERS[:2]
    sc = Scenario(specs, "decode", seed=5)
    shape = GraphShape(len(sc.md.qo_lens), 16)
    kernel = FlashInferKernel(unfused_attention=False, phases="decode")
    outs: dict[str, torch.Tensor] = {}

    def run(ctx) -> None:
        for s in specs:
            o = kernel.attend(ctx, s, sc.q[s.name], sc.caches[s.name], 1.0, 1.0, None,
                              sc.scales[s.name])  # fmt: skip
            outs.setdefault(s.name, torch.empty_like(o)).copy_(o)

    md = sc.md
    with forward_context(md, specs, kernel, graph=shape) as ctx:
        run(ctx)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(ctx)
    for scale in (2.0, 0.5):
        for s in specs:
            sc.scales[s.name].mul_(scale)  # same buffers, new scales: the graph reads them
        with forward_context(md, specs, kernel, graph=shape):  # re-plan: refills the tables
            graph.replay()
        torch.cuda.synchronize()
        ref = sc.attend(FlashInferKernel(unfused_attention=False, phases="decode"))
        for s in specs:
            assert rel_err(outs[s.name], ref[s.name]) < 1e-3, (scale, s.name)
