"""FlashInferKernel: per-layer output against the reference kernel on the GPU; contract on CPU.

GPU tests (``-m gpu``) reuse few FlashInfer JIT variants (head size 128, GQA group 4, page 16):
fa2 {bf16, fp8 cache} x {global, sliding(+soft-cap for fp8)} and XQA {global, sliding} plus XQA
with FP8 output. A module fixture compiles them all in parallel first.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from tests.support.attention import VIEW_LAYOUTS, as_cache_view, as_view, check_ops_on_views
from torch_kvq.attention import PageAllocator, ReferenceKernel, forward_context
from torch_kvq.attention.kernels import FlashInferKernel, KernelUnsupportedError
from torch_kvq.attention.kernels import capabilities as caps
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig, LayerKVSpec
from torch_kvq.spec_modes import FP8_DTYPE, KVQuantMode
from torch_kvq.spec_resolve import resolve_layer_specs

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (and FlashInfer)")
PAGE, D, WINDOW, SOFT_CAP = 16, 128, 64, 5.0
K_SCALE, V_SCALE, OUT_SCALE = 1 / 64, 1 / 32, 1 / 128
# relative Frobenius error against the reference kernel reading the same cache, per kernel
TOL = {"fa2": 1e-2, "fa3": 1e-2, "xqa": 8e-2, "xqa_fp8_out": 1e-1, "fa3_fp8": 8e-2}


def make_specs(infos: list[AttentionLayerInfo], skip: tuple[str, ...]) -> list[LayerKVSpec]:
    cfg = KVCacheConfig(
        "fp8", skip_layers=skip, page_size=PAGE, default_k_scale=K_SCALE, default_v_scale=V_SCALE
    )
    return list(resolve_layer_specs(cfg, infos, torch.bfloat16))


MIXED = make_specs(
    [
        AttentionLayerInfo("m.g_bf16", 8, 2, D),
        AttentionLayerInfo("m.g_fp8", 8, 2, D, sm_scale=0.05),
        AttentionLayerInfo("m.s_bf16", 8, 2, D, sliding_window=WINDOW),
        AttentionLayerInfo("m.s_fp8_cap", 8, 2, D, sliding_window=WINDOW, logits_soft_cap=SOFT_CAP),
        AttentionLayerInfo("m.mha_bf16", 4, 4, D),
    ],
    skip=("m.g_bf16", "m.s_bf16", "m.mha_bf16"),
)
NO_CAP = [s for s in MIXED if not s.logits_soft_cap]  # fa3's FP8 kernel has no soft-cap
XQA_INFOS = [
    AttentionLayerInfo("x.g_fp8", 8, 2, D),
    AttentionLayerInfo("x.s_fp8", 8, 2, D, sliding_window=WINDOW),
]
XQA = make_specs(XQA_INFOS, skip=())
# (history {seq: kv tokens already cached}, step [(seq, new tokens)])
BATCHES = {
    "prefill": ({}, [(10, 40), (11, 130), (12, 17)]),
    "decode": ({0: 15, 1: 16, 2: 200, 3: 77}, [(0, 1), (1, 1), (2, 1), (3, 1)]),
    "mixed": ({0: 15, 1: 100}, [(0, 1), (1, 37), (5, 50)]),
    # fresh prompts far longer than the window: fa3's paged loader starts sliding layers' query
    # tiles past tile 0 (its swa_begin_kv_tile_idx > 0), which shorter batches never reach
    "long": ({}, [(20, 600), (21, 300)]),
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


class Scenario:
    """Random paged caches (poisoned everywhere), a cached history, and one step's batch."""

    def __init__(self, specs: list[LayerKVSpec], batch: str, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.specs, dev = specs, "cuda"
        self.caches = {}
        for s in specs:
            shape = (64, 2, PAGE, s.num_kv_heads, s.head_size)
            poison = torch.randn(shape, device=dev) * 4
            self.caches[s.name] = poison.to(s.storage_dtype)
        alloc = PageAllocator(num_pages=64, page_size=PAGE)
        hist, step = BATCHES[batch]
        if hist:
            self._write(alloc.build_batch(list(hist.items()), device=dev))
        self.md = alloc.build_batch(step, device=dev)
        self._write(self.md)
        t = self.md.num_tokens
        self.q = {
            s.name: torch.randn(t, s.num_heads, D, device=dev, dtype=torch.bfloat16) * 2
            for s in specs
        }

    def _write(self, md) -> None:
        with forward_context(md, self.specs, ReferenceKernel()):
            for s in self.specs:
                k, v = (
                    torch.randn(
                        md.num_tokens, s.num_kv_heads, D, device="cuda", dtype=torch.bfloat16
                    )
                    for _ in "kv"
                )
                if s.is_quantized:
                    torch.ops.kvq.quant_cache_write(
                        k, v, self.caches[s.name], s.k_scale, s.v_scale, s.name
                    )
                else:
                    torch.ops.kvq.cache_write(k, v, self.caches[s.name], s.name)

    def attend(self, kernel, output_scale: float | None = None) -> dict[str, torch.Tensor]:
        out = {}
        with forward_context(self.md, self.specs, kernel):
            for s in self.specs:
                q, cache = self.q[s.name], self.caches[s.name]
                if s.is_quantized:
                    out[s.name] = torch.ops.kvq.paged_attention_fp8(
                        q, cache, s.k_scale, s.v_scale, s.name, output_scale
                    )
                else:
                    out[s.name] = torch.ops.kvq.paged_attention(q, cache, s.name)
        return out


@pytest.fixture(scope="module")
def built() -> None:
    """Compile every FlashInfer module these tests use, in parallel (first use otherwise stalls)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    from torch_kvq.attention.kernels import flashinfer_jit as jit

    mods = {}
    mods.update(jit.jit_specs(FlashInferKernel(unfused_attention=False), MIXED))
    mods.update(jit.jit_specs(FlashInferKernel(unfused_attention=True), MIXED[:2]))
    xk = FlashInferKernel(fp8_decode="xqa", phases="decode", unfused_attention=False)
    mods.update(jit.jit_specs(xk, XQA[:1], fp8_output=True))
    mods.update(jit.jit_specs(xk, XQA[1:]))
    # fp16 fa2 modules: not used here but by tests/passes's FlashInfer grid, which runs after
    # this file in ``pytest -m gpu``; built in the same parallel batch (saves ~1 min of device time)
    fp16 = list(
        resolve_layer_specs(KVCacheConfig("fp8", page_size=PAGE), XQA_INFOS[:1], torch.float16)
    )
    mods.update(jit.jit_specs(FlashInferKernel(unfused_attention=True), fp16, phases=("prefill",)))
    # fa3 modules (~100 s each), in this one batch
    mods.update(jit.jit_specs(FlashInferKernel(unfused_attention=False, prefill="fa3"), MIXED))
    fa3_fp8 = FlashInferKernel(unfused_attention=False, prefill="fa3_fp8")
    mods.update(jit.jit_specs(fa3_fp8, NO_CAP, phases=("prefill",)))
    model_math = FlashInferKernel(unfused_attention=False, fp8_decode_math="model")
    mods.update(jit.jit_specs(model_math, MIXED, phases=("decode",)))
    jit.build(mods, max_workers=len(mods))


# -- GPU: numerics against the reference kernel ------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_tensor_core_kernel_matches_reference(built, batch: str) -> None:
    sc = Scenario(MIXED, batch)
    ref = sc.attend(ReferenceKernel())
    out = sc.attend(FlashInferKernel(unfused_attention=False))
    for s in MIXED:
        assert out[s.name].dtype == torch.bfloat16 and out[s.name].shape == ref[s.name].shape
        assert torch.isfinite(out[s.name]).all(), s.name
        err = rel_err(out[s.name], ref[s.name])
        assert err < TOL["fa2"], f"{batch} {s.name}: rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch", ["prefill", "mixed", "long"])
def test_fa3_prefill_matches_reference(built, batch: str) -> None:
    """prefill='fa3': bf16 layers (global, sliding, MHA) on fa3, FP8 layers on fa2."""
    sc = Scenario(MIXED, batch)
    ref = sc.attend(ReferenceKernel())
    kernel = FlashInferKernel(unfused_attention=False, prefill="fa3")
    out = sc.attend(kernel)
    for s in MIXED:
        assert out[s.name].dtype == torch.bfloat16, s.name
        err = rel_err(out[s.name], ref[s.name])
        assert err < TOL["fa3"], f"{batch} {s.name}: rel err {err:.2e}"
        want = "fa2-prefill" if s.is_quantized else "fa3-prefill"
        assert kernel.variant(s, "prefill") == want, s.name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch", ["prefill", "mixed", "long"])
@pytest.mark.parametrize("scales", ["suite", "small"])
def test_fa3_fp8_prefill_matches_reference(built, batch: str, scales: str) -> None:
    """prefill='fa3_fp8': FP8 layers on fa3's FP8 kernel (FP8 query: XQA's accuracy class), on
    short prompts with partly filled last pages and cached prefixes (run 16 found 0.73 here before
    the query-scale floor), also at small k scales (the finite mask's worst case)."""
    specs = NO_CAP
    if scales == "small":
        specs = [
            dataclasses.replace(s, k_scale=s.k_scale / 8) if s.is_quantized else s for s in specs
        ]
    sc = Scenario(specs, batch)
    ref = sc.attend(ReferenceKernel())
    kernel = FlashInferKernel(unfused_attention=False, prefill="fa3_fp8")
    out = sc.attend(kernel)
    for s in specs:
        err = rel_err(out[s.name], ref[s.name])
        tol = TOL["fa3_fp8"] if s.is_quantized else TOL["fa3"]
        assert err < tol, f"{scales} {batch} {s.name}: rel err {err:.2e}"
        want = "fa3-fp8-prefill" if s.is_quantized else "fa3-prefill"
        assert kernel.variant(s, "prefill") == want, s.name


@pytest.mark.gpu
@needs_gpu
def test_fp16_decode_math_is_more_accurate_than_bf16(built) -> None:
    """The tensor-core FP8 decode in fp16 (default) and in the model dtype: both within fa2's
    tolerance, fp16 not worse (its mantissa is longer; the cache widens exactly into both)."""
    sc = Scenario(MIXED, "decode")
    ref = sc.attend(ReferenceKernel())
    fp16 = sc.attend(FlashInferKernel(unfused_attention=False))
    model = sc.attend(FlashInferKernel(unfused_attention=False, fp8_decode_math="model"))
    for s in (x for x in MIXED if x.is_quantized):
        e16, em = rel_err(fp16[s.name], ref[s.name]), rel_err(model[s.name], ref[s.name])
        assert fp16[s.name].dtype == torch.bfloat16
        assert e16 < TOL["fa2"] and em < TOL["fa2"], (s.name, e16, em)
        assert e16 <= em * 1.1, f"{s.name}: fp16 math {e16:.2e} vs bf16 math {em:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("fp8_out", [False, True], ids=["bf16_out", "fp8_out"])
def test_xqa_decode_matches_reference(built, fp8_out: bool) -> None:
    specs = XQA if not fp8_out else XQA[:1]
    sc = Scenario(specs, "decode", seed=1)
    ref = sc.attend(ReferenceKernel())
    kernel = FlashInferKernel(fp8_decode="xqa", phases="decode", unfused_attention=False)
    out = sc.attend(kernel, output_scale=OUT_SCALE if fp8_out else None)
    for s in specs:
        o = out[s.name]
        assert o.dtype == (FP8_DTYPE if fp8_out else torch.bfloat16), s.name
        o = o.float() * OUT_SCALE if fp8_out else o
        assert torch.isfinite(o).all(), s.name
        err = rel_err(o, ref[s.name])
        assert err < TOL["xqa_fp8_out" if fp8_out else "xqa"], f"{s.name}: rel err {err:.2e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("phases", ["decode", "any"])
@pytest.mark.parametrize("math", ["fp16", "model"])
def test_triton_decode_matches_reference(built, phases: str, math: str) -> None:
    """fp8_decode="triton": FP8 layers (global, sliding + soft-cap) on our Triton kernel, bf16
    layers on FlashInfer's decode; accurate like the tensor-core path."""
    sc = Scenario(MIXED, "decode", seed=2)
    ref = sc.attend(ReferenceKernel())
    kernel = FlashInferKernel(
        fp8_decode="triton", phases=phases, unfused_attention=False, fp8_decode_math=math
    )
    out = sc.attend(kernel)
    for s in MIXED:
        assert out[s.name].dtype == torch.bfloat16 and torch.isfinite(out[s.name]).all(), s.name
        err = rel_err(out[s.name], ref[s.name])
        assert err < TOL["fa2"], f"{s.name}: rel err {err:.2e}"
    with pytest.raises(KernelUnsupportedError, match="Triton decode cannot write FP8 output"):
        sc.attend(kernel, output_scale=OUT_SCALE)


@pytest.mark.gpu
@needs_gpu
def test_unfused_eager_form_runs_on_flashinfer(built) -> None:
    from torch_kvq.attention import Attention

    info = AttentionLayerInfo(f"unfused{id(object())}.g_fp8", 8, 2, D, sm_scale=0.05)
    (spec,) = make_specs([info], skip=())
    layer = Attention(spec, num_pages=64, device="cuda")
    md = PageAllocator(64, PAGE).build_batch([(0, 33), (1, 1)], device="cuda")
    q = torch.randn(md.num_tokens, 8, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(md.num_tokens, 2, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    with forward_context(md, [spec], ReferenceKernel()):
        ref = layer(q, k, v)
    with forward_context(md, [spec], FlashInferKernel(unfused_attention=True)):
        out = layer(q, k, v)
    assert rel_err(out, ref) < TOL["fa2"]
    with forward_context(md, [spec], FlashInferKernel(unfused_attention=False)):
        with pytest.raises(KernelUnsupportedError, match="unfused_attention=True"):
            layer(q, k, v)


@pytest.mark.gpu
@needs_gpu
def test_compiled_fused_ops_match_eager(built) -> None:
    spec = MIXED[1]
    sc = Scenario([spec], "mixed", seed=2)
    kernel = FlashInferKernel(unfused_attention=False)
    k, v = (torch.randn(sc.md.num_tokens, 2, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")

    def step(q, k, v, cache):
        torch.ops.kvq.quant_cache_write(k, v, cache, spec.k_scale, spec.v_scale, spec.name)
        return torch.ops.kvq.paged_attention_fp8(q, cache, spec.k_scale, spec.v_scale, spec.name)

    cache = sc.caches[spec.name]
    with forward_context(sc.md, [spec], kernel):
        eager = step(sc.q[spec.name], k, v, cache.clone())
        compiled = torch.compile(step, fullgraph=True)(sc.q[spec.name], k, v, cache.clone())
    with forward_context(sc.md, [spec], ReferenceKernel()):
        ref = step(sc.q[spec.name], k, v, cache.clone())
    assert rel_err(compiled, eager) < 1e-3
    assert rel_err(compiled, ref) < TOL["fa2"]


# -- GPU: contract ------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("layout", VIEW_LAYOUTS)
def test_opcheck_every_op_on_views(built, fp8_safe_allclose, layout: str) -> None:
    """tests/attention/test_ops.py's view test on the GPU: q / k / v (and caches) as
    non-contiguous views through FlashInfer (fa2 on a mixed batch, XQA decode with FP8 output) and
    the Triton cache write. Each op returns a new contiguous tensor, its fake says so (opcheck)."""
    ops = torch.ops.kvq
    bf16, fp8 = MIXED[0], MIXED[1]
    sc = Scenario([bf16, fp8], "mixed", seed=3)
    t, ks, vs = sc.md.num_tokens, fp8.k_scale, fp8.v_scale
    k, v = (torch.randn(t, 2, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    kq, vq = ops.quantize_fp8(k, ks), ops.quantize_fp8(v, vs)
    c16, c8 = sc.caches[bf16.name], sc.caches[fp8.name]
    q16, q8 = sc.q[bf16.name], sc.q[fp8.name]
    kv_, vv, kqv, vqv, q16v, q8v = (as_view(x, layout) for x in (k, v, kq, vq, q16, q8))
    cases = [
        (ops.quantize_fp8, (kv_, ks), (k, ks)),
        (
            ops.dequantize_kv_cache,
            (as_cache_view(c8), ks, vs, torch.float32, fp8.name),
            (c8, ks, vs, torch.float32, fp8.name),
        ),
        (ops.cache_write, (kqv, vqv, as_cache_view(c8), fp8.name), (kq, vq, c8, fp8.name)),
        (ops.cache_write, (kv_, vv, as_cache_view(c16), bf16.name), (k, v, c16, bf16.name)),
        (
            ops.quant_cache_write,
            (kv_, vv, as_cache_view(c8), ks, vs, fp8.name),
            (k, v, c8, ks, vs, fp8.name),
        ),
    ]
    attention = [
        (ops.paged_attention, (q16v, c16, bf16.name), (q16, c16, bf16.name)),
        (ops.paged_attention_fp8, (q8v, c8, ks, vs, fp8.name), (q8, c8, ks, vs, fp8.name)),
    ]
    with forward_context(sc.md, sc.specs, FlashInferKernel(unfused_attention=False)):
        check_ops_on_views(cases)
        check_ops_on_views(attention, exact=False)
    spec = XQA[0]
    sc = Scenario([spec], "decode", seed=4)
    q = sc.q[spec.name]
    args = (sc.caches[spec.name], spec.k_scale, spec.v_scale, spec.name, OUT_SCALE)
    xqa = FlashInferKernel(fp8_decode="xqa", phases="decode", unfused_attention=False)
    with forward_context(sc.md, sc.specs, xqa):
        check_ops_on_views(
            [(ops.paged_attention_fp8, (as_view(q, layout), *args), (q, *args))], exact=False
        )


@pytest.mark.gpu
@needs_gpu
def test_fp8_output_refused_where_no_kernel_writes_it(built) -> None:
    sc = Scenario(MIXED[:2], "decode")
    with pytest.raises(KernelUnsupportedError, match="m.g_fp8.*cannot write FP8 output"):
        sc.attend(FlashInferKernel(unfused_attention=False), output_scale=OUT_SCALE)
    sc = Scenario(XQA[:1], "prefill")
    with pytest.raises(KernelUnsupportedError, match="decode-only"):
        sc.attend(FlashInferKernel(fp8_decode="xqa", phases="decode"))


@pytest.mark.gpu
@needs_gpu
def test_layers_of_one_group_share_one_plan(built) -> None:
    from torch_kvq.attention.kernels.flashinfer_plan import GroupPlan

    infos = [AttentionLayerInfo(f"p.l{i}", 8, 2, D) for i in range(4)]
    specs = make_specs(infos, skip=("p.l3",))  # three FP8 layers, one bf16
    md = PageAllocator(16, PAGE).build_batch([(0, 20)], device="cuda")
    kernel = FlashInferKernel(unfused_attention=False)
    with forward_context(md, specs, kernel) as ctx:
        groups = {p.key for p in ctx.plans.values() if isinstance(p, GroupPlan)}
        fp8_plans = {id(ctx.plans[(id(kernel), f"p.l{i}", FP8_DTYPE)]) for i in range(3)}
    assert sorted(k.kv_dtype == FP8_DTYPE for k in groups) == [False, True]
    assert len(fp8_plans) == 1  # one plan (one wrapper) serves the three FP8 layers
    kernel = FlashInferKernel(unfused_attention=True)
    with forward_context(md, specs, kernel) as ctx:
        groups = {p.key for p in ctx.plans.values() if isinstance(p, GroupPlan)}
        unfused = ctx.plans[(id(kernel), "p.l0", torch.bfloat16)]
        assert unfused is ctx.plans[(id(kernel), "p.l3", torch.bfloat16)]
    assert len(groups) == 2  # the FP8 layers' bf16 (unfused) plan is the bf16 layer's plan


@pytest.mark.gpu
@needs_gpu
def test_xqa_refuses_soft_cap_and_reports_fp8_output_support() -> None:
    xqa = FlashInferKernel(fp8_decode="xqa", phases="decode")
    with pytest.raises(KernelUnsupportedError, match="m.s_fp8_cap.*soft-cap"):
        xqa.check_supported(MIXED[3])
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert xqa.fp8_output_supported(XQA[0]) is sm90
    assert not xqa.fp8_output_supported(MIXED[0])  # bf16 cache: nothing to claim
    assert not FlashInferKernel(fp8_decode="xqa").fp8_output_supported(XQA[0])  # prefill too
    assert not FlashInferKernel(phases="decode").fp8_output_supported(XQA[0])


# -- CPU: contract (runs everywhere) --------------------------------------------------------------


def test_importing_torch_kvq_never_imports_flashinfer() -> None:
    """Nor a Triton program (``attention/triton/*`` import Triton, an optional dependency; all
    but ``decode_config``, the decode's host logic, which the launchers import)."""
    code = (
        "import sys, torch_kvq\n"
        "import torch_kvq.attention.ops, torch_kvq.attention.triton\n"
        "from torch_kvq.attention.kernels import FlashInferKernel\n"
        "FlashInferKernel(fp8_decode='xqa'), FlashInferKernel(fp8_decode='triton')\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer was imported'\n"
        "programs = [m for m in sys.modules if m.startswith('torch_kvq.attention.triton.')]\n"
        "assert set(programs) <= {'torch_kvq.attention.triton.decode_config'}, programs\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fp8_decode": "cuda_cores"}, "fp8_decode 'cuda_cores' unknown"),
        ({"phases": "prefill"}, "phases 'prefill' unknown"),
        ({"workspace_bytes": 1024}, "workspace_bytes must be an int >= 16 MiB, got 1024"),
        ({"prefill": "fa4"}, "prefill 'fa4' unknown; expected 'fa2', 'fa3' or 'fa3_fp8'"),
        ({"prefill": "fa3", "phases": "decode"}, "a decode-only kernel runs no prefill"),
        ({"fp8_decode_math": "tf32"}, "fp8_decode_math 'tf32' unknown"),
    ],
)
def test_constructor_rejects_bad_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FlashInferKernel(**kwargs)


def test_configuration_names_match_capability_rows() -> None:
    fp8_layer = (KVQuantMode.FP8_PER_TENSOR, torch.bfloat16)
    for fp8_decode in ("tensor_cores", "xqa", "triton"):
        for phases in ("any", "decode"):
            name = FlashInferKernel(fp8_decode=fp8_decode, phases=phases).name
            assert name in caps.known_kernels()
            assert caps.supports(name, "sm90", *fp8_layer, False)
            writes_fp8 = fp8_decode == "xqa" and phases == "decode"
            assert caps.supports(name, "sm90", *fp8_layer, True) is writes_fp8, name
    assert not caps.supports("flashinfer-xqa-decode", "sm100", *fp8_layer, True)
    for name in ("flashinfer-triton", "flashinfer-triton-decode"):  # our kernel: sm90 only
        assert caps.unsupported_reason(name, "sm90", MIXED[3]) is None  # FP8, window, soft-cap
        assert "quant mode 'fp8_per_tensor' is not supported" in caps.unsupported_reason(
            name, "sm80", MIXED[1]
        )
        assert caps.unsupported_reason(name, "sm80", MIXED[0]) is None  # bf16 layers: fa2


def test_xqa_block_table_matches_page_tables() -> None:
    md = PageAllocator(64, PAGE).build_batch([(0, 1), (1, 300), (2, 16), (3, 17)])
    from torch_kvq.attention.kernels.flashinfer_xqa import block_tables

    t = block_tables(md, None)
    width = max(len(p) for p in md.page_tables)
    dense = [list(p) + [0] * (width - len(p)) for p in md.page_tables]
    assert t.block_tables.tolist() == dense and t.block_tables.dtype == torch.int32
    # XQA sizes its grid from the table's width (in tokens), whatever max_seq_len says
    assert t.seq_lens.tolist() == [1, 300, 16, 17] and t.max_seq_len == width * PAGE


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU error")
def test_check_supported_without_cuda_names_layer() -> None:
    with pytest.raises(KernelUnsupportedError, match="m.g_fp8.*CUDA GPU"):
        FlashInferKernel().check_supported(MIXED[1])


def test_group_keys_follow_prefill_and_decode_math_options() -> None:
    """Which kernel, query dtype and output dtype each option plans (no GPU needed)."""
    bf16, fp8 = MIXED[0], MIXED[1]

    def key(kernel: FlashInferKernel, spec: LayerKVSpec, decode: bool):
        k = kernel._group_key(spec, spec.storage_dtype, decode)
        return k.kernel, k.backend, k.q_dtype, k.o_dtype

    bf, f16 = torch.bfloat16, torch.float16
    default = FlashInferKernel()
    assert key(default, bf16, False) == ("prefill", "fa2", bf, bf)
    assert key(default, fp8, False) == ("prefill", "fa2", bf, bf)
    assert key(default, fp8, True) == ("decode", "fa2", f16, bf)  # fp16 math, bf16 output
    assert key(default, bf16, True) == ("decode", "fa2", bf, bf)  # bf16 cache: model dtype
    model_math = FlashInferKernel(fp8_decode_math="model")
    assert key(model_math, fp8, True) == ("decode", "fa2", bf, bf)
    fa3 = FlashInferKernel(prefill="fa3")
    assert key(fa3, bf16, False) == ("prefill", "fa3", bf, bf)
    assert key(fa3, fp8, False) == ("prefill", "fa2", bf, bf)  # fa3 has no bf16-q / FP8-KV kernel
    fa3_fp8 = FlashInferKernel(prefill="fa3_fp8")
    assert key(fa3_fp8, fp8, False) == ("prefill", "fa3", FP8_DTYPE, bf)
    assert key(fa3_fp8, bf16, False) == ("prefill", "fa3", bf, bf)
    assert key(fa3_fp8, fp8, True) == ("decode", "fa2", f16, bf)
    xqa = FlashInferKernel(fp8_decode="xqa")
    assert key(xqa, fp8, True) == ("xqa", "fa2", bf, bf)  # XQA reads the model-dtype query
    triton = FlashInferKernel(fp8_decode="triton")
    assert key(triton, fp8, True) == ("triton", "fa2", f16, bf)  # widened to fp16 in-kernel
    assert key(triton, bf16, True) == ("decode", "fa2", bf, bf)  # bf16 cache: FlashInfer
    assert key(triton, fp8, False) == ("prefill", "fa2", bf, bf)
    triton_model = FlashInferKernel(fp8_decode="triton", fp8_decode_math="model")
    assert key(triton_model, fp8, True) == ("triton", "fa2", bf, bf)
    assert triton.name == "flashinfer-triton" and "fp8_decode='triton'" in repr(triton)
    assert "prefill='fa3'" in repr(fa3) and "fp8_decode_math='model'" in repr(model_math)


def test_fa3_prefill_refused_off_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    kernel = FlashInferKernel(prefill="fa3")
    monkeypatch.setattr(kernel, "arch", lambda: "sm80")
    with pytest.raises(KernelUnsupportedError, match="prefill='fa3'.*sm90 only.*sm80"):
        kernel.check_supported(MIXED[0])
    monkeypatch.setattr(FlashInferKernel, "arch", lambda self: "sm90")
    FlashInferKernel(prefill="fa3").check_supported(MIXED[1])
    FlashInferKernel(prefill="fa3_fp8").check_supported(MIXED[1])
    capped = next(s for s in MIXED if s.is_quantized and s.logits_soft_cap)
    with pytest.raises(KernelUnsupportedError, match=f"{capped.name}.*soft-cap.*prefill='fa3'"):
        FlashInferKernel(prefill="fa3_fp8").check_supported(capped)
    FlashInferKernel(prefill="fa3").check_supported(capped)  # fa2 serves its prefill


def test_quantize_query_floors_the_scale_for_the_finite_mask() -> None:
    """fa3's FP8 kernel masks raw code logits with -5e4: the scale keeps that >= 100 below zero
    in real logit units, and never lets a code exceed 448."""
    from torch_kvq.attention.kernels.flashinfer_fa3_fp8 import quantize_query

    q = torch.randn(37, 4, 64, dtype=torch.bfloat16) * 3
    amax = float(q.abs().amax())
    q8, scale = quantize_query(q, k_logit_scale=1.0)  # large: the amax rule wins
    assert q8.dtype == FP8_DTYPE and scale == pytest.approx(amax / 448)
    assert float(q8.float().abs().amax()) == 448.0
    assert rel_err(q8.float() * scale, q) < 4e-2
    ks_sm = (1 / 64) * 0.05  # run 16's failing layer: k_scale 1/64, sm_scale 0.05
    q8, scale = quantize_query(q, k_logit_scale=ks_sm)
    assert 5e4 * scale * ks_sm == pytest.approx(100.0) and scale > amax / 448
    assert rel_err(q8.float() * scale, q) < 4e-2  # smaller codes, same relative precision
    with pytest.raises(ValueError, match="k_scale \\* sm_scale must be > 0"):
        quantize_query(q, 0.0)
