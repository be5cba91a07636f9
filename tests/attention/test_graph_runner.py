"""DecodeGraphRunner: padded fixed-buffer decode steps equal direct calls; bad batches raise.

CPU: ``capture=False`` runs the whole fixed-buffer path (padding, scratch page, staging, the
static metadata views, re-planning per step) with the reference kernel. GPU (``gpu`` marker):
captured graphs on FlashInfer, compiled with kvq_backend, against uncaptured steps.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.attention import k_basis
from tests.support.passes import DETERMINISTIC
from torch_kvq import KVCacheConfig
from torch_kvq.attention import BatchMetadata
from torch_kvq.attention.graph_runner import PAD_SEQUENCE, DecodeGraphRunner
from torch_kvq.attention.kernels import FlashInferKernel
from torch_kvq.attention.metadata import GraphShape
from torch_kvq.models import build_model

MIXED = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=4)
PROMPTS = {0: 5, 1: 9, 2: 3, 3: 12}
# decode steps: which sequences take a token (sizes 3 -> slot 4, 1 -> slot 2, 4, 2)
SCHEDULE = [(0, 1, 2), (0, 1, 2), (1,), (0, 1, 2, 3), (3, 0), (2, 3, 1)]


# Padded batches change the GEMM shapes, so k / v may differ in the last fp32 bits; a value that
# sits on an e4m3 rounding boundary then lands one FP8 step away (<= 1/8 relative, 2^-9 absolute
# near zero), which moves the logits by ~1e-4.
CPU_LOGIT_TOL = 1e-3
CPU_CACHE_TOL = dict(atol=2e-3, rtol=0.125)


def _twins(cfg=MIXED, num_pages=64, **kw):
    """Two identical models; the direct one reserves a page like the runner's scratch page so
    page ids agree."""
    direct = build_model("gemma3-tiny", cfg, num_pages=num_pages, dtype=torch.float32, **kw)
    graphed = build_model("gemma3-tiny", cfg, num_pages=num_pages, dtype=torch.float32, **kw)
    direct.allocator.append(PAD_SEQUENCE, 1)
    return direct, graphed


def _prefill(model, prompts: dict[int, int], gen: torch.Generator, fn=None) -> None:
    """One prefill batch of ``prompts`` (sequence -> length) through ``fn`` (default: eager)."""
    ids = torch.randint(0, model.config.vocab_size, (sum(prompts.values()),), generator=gen)
    md = model.allocator.build_batch(list(prompts.items()), device=model.device)
    with torch.no_grad(), model.forward_context(md):
        (model if fn is None else fn)(ids.to(model.device), md.positions)


def _direct_step(model, fn, ids: torch.Tensor, seqs) -> torch.Tensor:
    md = model.allocator.build_batch([(s, 1) for s in seqs], device=model.device)
    with torch.no_grad(), model.forward_context(md):
        return fn(ids, md.positions)


def _run_schedule(direct, graphed, runner, fn_direct=None, device="cpu"):
    """Same prompts and tokens on both models; returns per-step max |logit diff|."""
    gens = [torch.Generator().manual_seed(0) for _ in range(2)]
    _prefill(direct, PROMPTS, gens[0])
    _prefill(graphed, PROMPTS, gens[1])
    errs, gen = [], torch.Generator().manual_seed(1)
    for seqs in SCHEDULE:
        ids = torch.randint(0, direct.config.vocab_size, (len(seqs),), generator=gen).to(device)
        want = _direct_step(direct, direct if fn_direct is None else fn_direct, ids, seqs)
        md = graphed.allocator.build_batch([(s, 1) for s in seqs], device="cpu")
        got = runner(ids, md)
        assert got.shape == want.shape
        errs.append(float((got.float() - want.float()).abs().max()))
    return errs


def _assert_caches_match(direct, graphed, scratch: int, atol: float, rtol: float = 0.0) -> None:
    for a, b in zip(direct.attention_layers, graphed.attention_layers):
        for seq in PROMPTS:
            pages = list(direct.allocator.pages(seq))
            assert pages == list(graphed.allocator.pages(seq))
            torch.testing.assert_close(
                b.kv_cache[pages].float(), a.kv_cache[pages].float(), atol=atol, rtol=rtol
            )
        free = sorted(
            set(range(b.kv_cache.shape[0]))
            - {p for s in graphed.allocator.sequences for p in graphed.allocator.pages(s)}
        )
        assert scratch not in free
        assert not b.kv_cache[free].float().abs().any(), "padding wrote outside its scratch page"
        assert b.kv_scale is None or not b.kv_scale[free].any(), "padding wrote stray scales"


def test_padded_steps_match_direct_calls():
    direct, graphed = _twins()
    runner = DecodeGraphRunner(graphed, batch_sizes=(2, 4), max_context=32, capture=False)
    errs = _run_schedule(direct, graphed, runner)
    assert max(errs) < CPU_LOGIT_TOL, errs
    _assert_caches_match(direct, graphed, runner.scratch_page, **CPU_CACHE_TOL)
    assert runner.captured_sizes == ()  # capture=False never captures
    assert graphed.allocator.pages(runner.pad_sequence) == (runner.scratch_page,)
    runner.close()
    assert runner.pad_sequence not in graphed.allocator.sequences


def test_compiled_model_through_the_runner():
    from torch_kvq import make_kvq_backend

    direct, graphed = _twins()
    compiled = torch.compile(graphed, backend=make_kvq_backend(inner="eager"))
    runner = DecodeGraphRunner(graphed, compiled, batch_sizes=(2, 4), max_context=32, capture=False)
    errs = _run_schedule(direct, graphed, runner)
    assert max(errs) < CPU_LOGIT_TOL, errs
    _assert_caches_match(direct, graphed, runner.scratch_page, **CPU_CACHE_TOL)


def _map_through_runner(cfg: KVCacheConfig, modes: list[str]):
    """Twins of ``cfg`` (their layers' modes ``modes``), the graphed one compiled with the passes
    and run through a fixed-buffer runner, the schedule's logits within ``CPU_LOGIT_TOL`` of the
    direct one's: (direct, graphed, runner), for the caller to check the caches."""
    from torch_kvq import make_kvq_backend

    direct, graphed = _twins(cfg)
    assert [s.mode.value for s in graphed.kv_specs] == modes
    compiled = torch.compile(graphed, backend=make_kvq_backend(inner="eager"))
    runner = DecodeGraphRunner(graphed, compiled, batch_sizes=(2, 4), max_context=32, capture=False)
    errs = _run_schedule(direct, graphed, runner)
    assert max(errs) < CPU_LOGIT_TOL, errs
    return direct, graphed, runner


# a per-layer map with issue 33's 4-bit modes: int4 (layers 0, 3), int8 per (token, head) (1),
# k8v4 on the global layers (2, 5), layer 4 in the model dtype
FOUR_BIT_MAP = KVCacheConfig(
    "int4_per_token_head",
    layer_modes=(
        ("full_attention", "k8v4_per_token_head"),
        (1, "int8_per_token_head"),
        (4, "auto"),
    ),
    page_size=4,
)


def test_a_map_with_four_bit_layers_through_the_runner():
    """Compiled (the fused per-(token, head) write and read) through the fixed-buffer path: the
    same logits as direct calls; every sequence's codes and scales those of the direct model, in
    the real units a code step allows (a padded GEMM may move k / v by an fp32 bit, and a value
    on a rounding boundary then takes the neighbouring code: within one step of its row's scale;
    measured on torch 2.13 CPU: every code equal); padding writes codes and scales only to the
    scratch page (int4's packed codes, k8v4's 3 slots)."""
    from torch_kvq.attention.quant import dequantize_pages_per_token_head

    direct, graphed, runner = _map_through_runner(FOUR_BIT_MAP, [
        "int4_per_token_head", "int8_per_token_head", "k8v4_per_token_head",
        "int4_per_token_head", "none", "k8v4_per_token_head",
    ])  # fmt: skip
    pages = torch.tensor(sorted({p for s in PROMPTS for p in direct.allocator.pages(s)}))
    for a, b in zip(direct.attention_layers, graphed.attention_layers):
        if a.kv_scale is None:
            continue
        want, got = (dequantize_pages_per_token_head(x.kv_cache, x.kv_scale, pages, torch.float32)
                     for x in (a, b))  # fmt: skip
        step = a.kv_scale[pages].amax().item()  # the coarsest row's code step (int4: zp bits)
        torch.testing.assert_close(got, want, atol=step * 1.001, rtol=0.0)
        torch.testing.assert_close(b.kv_scale[pages], a.kv_scale[pages], atol=0.0, rtol=1e-5)
    _assert_caches_match(direct, graphed, runner.scratch_page, atol=float("inf"))
    assert graphed.attention_layers[2].kv_cache[runner.scratch_page].any()  # padding: scratch


# tc4 (issue 33's transform-coded mode, the recommended map's) on the global layers (2, 5), each
# with its own K basis, int8 per (token, head) on layer 1, the rest in the model dtype
TC4_MAP = KVCacheConfig(
    "auto",
    layer_modes=(("full_attention", "tc4_per_token_head"), (1, "int8_per_token_head")),
    k_bases=((2, k_basis(2, 32, 2)), (5, k_basis(2, 32, 5))),
    page_size=4,
)


def test_a_map_with_tc4_layers_through_the_runner():
    """tc4 layers compiled (the fused write and read) through the fixed-buffer path: the same
    logits as direct calls, every sequence's tc4 pages those of the direct model within one code
    step of their coarsest group (a padded GEMM may move k / v by an fp32 bit; measured on torch
    2.13 CPU: every byte equal), and padding writes codes and side rows only to the scratch
    page."""
    from torch_kvq.attention import quant_tc

    direct, graphed, runner = _map_through_runner(TC4_MAP, [
        "none", "int8_per_token_head", "tc4_per_token_head",
        "none", "none", "tc4_per_token_head",
    ])  # fmt: skip
    pages = sorted({p for s in PROMPTS for p in direct.allocator.pages(s)})
    for i in (2, 5):
        a, b = direct.attention_layers[i], graphed.attention_layers[i]
        want, got = (quant_tc.dequantize_pages(x.kv_cache[pages], x.kv_scale[pages])
                     for x in (a, b))  # fmt: skip
        records = quant_tc.aux_from_cache(a.kv_scale[pages])  # [pages, page, KH, W]
        scales = records[..., : 2 * quant_tc.AUX_SLOTS].contiguous().view(torch.float16)
        step = scales[..., :5].float().amax().item()  # the coarsest group's code step
        torch.testing.assert_close(got, want, atol=step * 1.001, rtol=0.0)
    _assert_caches_match(direct, graphed, runner.scratch_page, atol=float("inf"))
    assert graphed.attention_layers[2].kv_cache[runner.scratch_page].any()  # padding: scratch


def test_a_refused_batch_changes_nothing_and_the_next_step_runs():
    """Every refusal is checked before any buffer is touched (the messages: docs/errors.md,
    section CUDA graphs): the caches stay bit-identical and the slot still serves."""
    direct, graphed = _twins()
    runner = DecodeGraphRunner(graphed, batch_sizes=(2, 4), max_context=16, capture=False)
    gens = [torch.Generator().manual_seed(0) for _ in range(2)]
    _prefill(direct, {0: 5, 1: 16}, gens[0])
    _prefill(graphed, {0: 5, 1: 16}, gens[1])
    ids = torch.tensor([3, 4])
    runner(ids[:1], graphed.allocator.build_batch([(0, 1)], device="cpu"))  # slot 2 in use
    _direct_step(direct, direct, ids[:1], [0])
    caches = [a.kv_cache.clone() for a in graphed.attention_layers]
    graphed.allocator.append(1, 1)  # sequence 1 at 17 tokens: over max_context
    md = BatchMetadata._from_host(
        torch.cat([torch.tensor(graphed.allocator.pages(s), dtype=torch.int32) for s in (0, 1)]),
        [len(graphed.allocator.pages(s)) for s in (0, 1)],
        [graphed.allocator.seq_len(s) for s in (0, 1)], [1, 1], 4, "cpu",
    )  # fmt: skip
    with pytest.raises(ValueError, match="more than max_context 16"):
        runner(ids, md)
    for a, c in zip(graphed.attention_layers, caches):
        assert torch.equal(a.kv_cache.view(torch.uint8), c.view(torch.uint8))
    direct.allocator.append(1, 1)
    graphed.allocator.free(1), direct.allocator.free(1)
    got = runner(ids[:1], graphed.allocator.build_batch([(0, 1)], device="cpu"))
    want = _direct_step(direct, direct, ids[:1], [0])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_xqa_block_table_gather():
    """Under a graph shape XQA's dense block table is one fixed buffer of the shape's width,
    refilled in place (the plain case: test_flashinfer_kernel.py)."""
    tables = [[7, 3, 9], [2], [5, 6]]
    md = BatchMetadata.build(tables, [10, 2, 5], [1, 1, 1], 4)
    from torch_kvq.attention.kernels.flashinfer_xqa import block_tables

    shape, buffers = GraphShape(3, 5), {}  # FlashInferKernel keeps one such dict
    g1 = block_tables(md, shape, buffers)
    assert g1.block_tables.tolist() == [[7, 3, 9, 0, 0], [2, 0, 0, 0, 0], [5, 6, 0, 0, 0]]
    assert g1.max_seq_len == 20
    md2 = BatchMetadata.build([[1], [4, 8], [11]], [3, 6, 1], [1, 1, 1], 4)
    g2 = block_tables(md2, shape, buffers)
    assert g2.block_tables.data_ptr() == g1.block_tables.data_ptr() and len(buffers) == 1
    assert g1.block_tables.tolist() == [[1, 0, 0, 0, 0], [4, 8, 0, 0, 0], [11, 0, 0, 0, 0]]


# -- GPU: real capture on FlashInfer ------------------------------------------------------------

HEAD = dict(head_dim=128, query_pre_attn_scalar=128)  # FlashInfer head sizes: 64, 128, 256


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8_decode", ["tensor_cores", "xqa", "triton"])
def test_captured_graphs_match_uncaptured_steps_on_flashinfer(fp8_decode):
    import torch_kvq
    from torch_kvq.attention.kernels.flashinfer_jit import prebuild

    kv = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=16)
    models = []
    for _ in range(2):
        kernel = FlashInferKernel(fp8_decode=fp8_decode)  # prefill runs eager (unfused)
        m = build_model("gemma3-tiny", kv, num_pages=64, device="cuda", kernel=kernel, **HEAD)
        prebuild(kernel, m.kv_specs)
        models.append(m)
    direct, graphed = models
    direct.allocator.append(PAD_SEQUENCE, 1)
    backend = torch_kvq.kvq_backend
    runner = DecodeGraphRunner(
        graphed, torch.compile(graphed, backend=backend), batch_sizes=(2, 4), max_context=64
    )
    errs = _run_schedule(
        direct, graphed, runner, torch.compile(direct, backend=backend), device="cuda"
    )
    assert runner.captured_sizes == (2, 4)
    # same kernels and weights; only the padded GEMM shapes differ (bf16 logits reach |5|)
    assert max(errs) <= 0.05, errs
    # a k/v that differs in its last bf16 bit may round to the neighbouring e4m3 value (1/8)
    _assert_caches_match(direct, graphed, runner.scratch_page, atol=0.05, rtol=0.125)


# per-(token, head) maps on the GPU (sm90, FlashInfer): the global layers in ``mode``, layer 0
# int8 per (token, head), the other sliding layers bf16. int4 / k8v4 / tc4: the Triton decode
# reading the packed codes, prefill on the dequantized scratch (tc4: each global layer with its
# own K basis).
GPU_MAP_MODES = ["int4_per_token_head", "k8v4_per_token_head", "tc4_per_token_head"]


def _map_copies_replay(mode: str, compile_with=None) -> tuple[list, list]:
    """Two identical gemma3-tiny copies of the per-(token, head) map (layer 0 int8 per (token,
    head), the global layers 2 and 5 in ``mode``, the other sliding layers bf16) on
    ``FlashInferKernel()`` (Triton decode reading the codes, prefill on the dequantized scratch),
    run as ``torch.compile(m, backend=compile_with)`` or eager (None). Both prefill the same
    prompts; then the same decode schedule runs through a ``capture=False`` runner and a
    capturing one: the same padded batches, buffers, plans and kernels, so the captured replays
    must give the uncaptured steps' logits and caches bit for bit (every code and scale, the
    scratch page's included), and padding writes only the scratch page. Returns (models,
    runners), the uncapturing copy first."""
    from torch_kvq.attention.kernels.flashinfer_jit import prebuild

    bases = ((2, k_basis(2, 128, 2)), (5, k_basis(2, 128, 5))) if "tc4" in mode else ()
    kv = KVCacheConfig(
        "auto",
        layer_modes=(("full_attention", mode), (0, "int8_per_token_head")),
        k_bases=bases,
        page_size=16,
    )
    models, runners = [], []
    for capture in (False, True):
        kernel = FlashInferKernel()
        m = build_model("gemma3-tiny", kv, num_pages=64, device="cuda", kernel=kernel, **HEAD)
        prebuild(kernel, m.kv_specs)
        fn = m if compile_with is None else torch.compile(m, backend=compile_with)
        runners.append(DecodeGraphRunner(m, fn, batch_sizes=(2, 4), max_context=64,
                                         capture=capture))  # fmt: skip
        _prefill(m, PROMPTS, torch.Generator().manual_seed(0), fn)
        models.append(m)
    uncaptured, graphed = models
    assert [s.mode.value for s in graphed.kv_specs] == [
        "int8_per_token_head", "none", mode, "none", "none", mode,
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    for seqs in SCHEDULE:
        ids = torch.randint(0, graphed.config.vocab_size, (len(seqs),), generator=gen).cuda()
        want, got = (r(ids, m.allocator.build_batch([(s, 1) for s in seqs], device="cpu"))
                     for r, m in zip(runners, models))  # fmt: skip
        assert torch.equal(got, want), (seqs, (got.float() - want.float()).abs().max().item())
    assert runners[1].captured_sizes == (2, 4) and runners[0].captured_sizes == ()
    for a, b in zip(uncaptured.attention_layers, graphed.attention_layers):
        assert torch.equal(b.kv_cache.view(torch.uint8), a.kv_cache.view(torch.uint8)), b.spec.name
        assert a.kv_scale is None or torch.equal(b.kv_scale, a.kv_scale), b.spec.name
    _assert_caches_match(uncaptured, graphed, runners[1].scratch_page, atol=0.0)
    return models, runners


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", GPU_MAP_MODES)
def test_captured_graphs_of_a_per_token_head_map_replay_the_uncaptured_steps(mode):
    """``_map_copies_replay`` compiled with kvq_backend: the compiled graphs fuse exactly the
    quantized layers (the fused write; the Triton decode reads the cache in place). Every compile
    of both copies is in Inductor's deterministic mode (``DETERMINISTIC``, given to the backend),
    so they generate the same reduction orders on a busy GPU; with a process-wide patch instead,
    the second copy compiled without it and its prefill parted from the first's in the last bits
    (docs/design/int4-branch.md, fiftieth session)."""
    import torch_kvq

    backend = torch_kvq.make_kvq_backend(config_patches=DETERMINISTIC)
    models, _ = _map_copies_replay(mode, backend)
    quantized = {s.name for m in models for s in m.kv_specs if s.is_quantized}
    # every quantized layer of both models went through the passes (how many graphs that takes
    # depends on what this process compiled before: once an earlier compile of this forward has
    # marked its batch dims dynamic, one graph serves prefill and decode)
    assert {n for manager in backend.managers for n in manager.last.layers} >= quantized
    for manager in backend.managers:
        rep = manager.last
        want = set(rep.layers) & quantized  # this model's layers 0, 2, 5
        assert len(want) == 3, (rep.summary(), want)
        assert set(rep.layers_fused("quant+write")) == want, rep.summary()
        assert set(rep.layers_fused("dequant+attn")) == want, rep.summary()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", GPU_MAP_MODES)
def test_captured_graphs_of_an_eager_per_token_head_map_replay_the_uncaptured_steps(mode):
    """``_map_copies_replay`` without torch.compile (the runner's default ``fn``): the readable
    eager ops (rotate, then quantize; the scratch prefill) run under capture, which needs every
    constant they read (the rotation's signs) on the device before the capture begins."""
    _map_copies_replay(mode)
