"""DecodeGraphRunner: padded fixed-buffer decode steps equal direct calls; bad batches raise.

CPU: ``capture=False`` runs the whole fixed-buffer path (padding, scratch page, staging, the
static metadata views, re-planning per step) with the reference kernel. GPU (``gpu`` marker):
captured graphs on FlashInfer, compiled with kvq_backend, against uncaptured steps.
"""

from __future__ import annotations

import pytest
import torch

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


def _twins(cfg=MIXED, num_pages=64, **kw):
    """Two identical models; the direct one reserves a page like the runner's scratch page so
    page ids agree."""
    direct = build_model("gemma3-tiny", cfg, num_pages=num_pages, dtype=torch.float32, **kw)
    graphed = build_model("gemma3-tiny", cfg, num_pages=num_pages, dtype=torch.float32, **kw)
    direct.allocator.append(PAD_SEQUENCE, 1)
    return direct, graphed


def _prefill(model, prompts: dict[int, int], gen: torch.Generator) -> None:
    ids = torch.randint(0, model.config.vocab_size, (sum(prompts.values()),), generator=gen)
    md = model.allocator.build_batch(list(prompts.items()), device=model.device)
    with torch.no_grad(), model.forward_context(md):
        model(ids.to(model.device), md.positions)


def _direct_step(model, fn, ids: torch.Tensor, seqs) -> torch.Tensor:
    md = model.allocator.build_batch([(s, 1) for s in seqs], device=model.device)
    with torch.no_grad(), model.forward_context(md):
        return fn(ids, md.positions)


def _run_schedule(direct, graphed, runner, fn_direct=None, device="cpu"):
    """Same prompts and tokens on both models; returns per-step max |logit diff|."""
    gens = [torch.Generator().manual_seed(0) for _ in range(2)]
    _prefill(direct, PROMPTS, gens[0])
    _prefill(graphed, PROMPTS, gens[1])
    errs = []
    for seqs in SCHEDULE:
        ids = torch.randint(0, direct.config.vocab_size, (len(seqs),)).to(device)
        want = _direct_step(direct, fn_direct or direct, ids, seqs)
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


def test_padded_steps_match_direct_calls():
    direct, graphed = _twins()
    runner = DecodeGraphRunner(graphed, batch_sizes=(2, 4), max_context=32, capture=False)
    errs = _run_schedule(direct, graphed, runner)
    assert max(errs) < 1e-4, errs
    _assert_caches_match(direct, graphed, runner.scratch_page, atol=1e-5)
    assert runner.captured_sizes == ()  # capture=False never captures
    assert graphed.allocator.pages(PAD_SEQUENCE) == (runner.scratch_page,)


def test_compiled_model_through_the_runner():
    from torch_kvq import make_kvq_backend

    direct, graphed = _twins()
    compiled = torch.compile(graphed, backend=make_kvq_backend(inner="eager"))
    runner = DecodeGraphRunner(graphed, compiled, batch_sizes=(2, 4), max_context=32, capture=False)
    errs = _run_schedule(direct, graphed, runner)
    assert max(errs) < 1e-4, errs
    _assert_caches_match(direct, graphed, runner.scratch_page, atol=1e-5)


@pytest.fixture(scope="module")
def ready():
    model = build_model("gemma3-tiny", MIXED, num_pages=32, dtype=torch.float32)
    runner = DecodeGraphRunner(model, batch_sizes=(1, 2), max_context=16, capture=False)
    model.allocator.append("a", 4)
    model.allocator.append("b", 16)
    return model, runner


def _decode_md(model, seqs, device="cpu"):
    return model.allocator.build_batch([(s, 1) for s in seqs], device=device)


BAD_STEPS = {
    "prefill": (
        lambda m: m.allocator.build_batch([("a", 2)]),
        2,
        "decode-only batches .* query lengths \\[2\\]",
    ),
    "too many": (
        lambda m: BatchMetadata.build([[20], [21], [22]], [1, 1, 1], [1, 1, 1], 4),
        3,
        "batch of 3 sequences exceeds the largest captured batch size 2",
    ),
    "too long": (lambda m: _decode_md(m, ["b"]), 1, "has 17 tokens, more than max_context 16"),
    "page size": (
        lambda m: BatchMetadata.build([[20]], [1], [1], 8),
        1,
        "metadata page_size 8, expected 4",
    ),
    "page range": (
        lambda m: BatchMetadata.build([[40]], [1], [1], 4),
        1,
        "uses KV page 40 but the caches have 32 pages",
    ),
    "scratch page": (
        lambda m: BatchMetadata.build([[0]], [1], [1], 4),
        1,
        "page 0, the runner's scratch page",
    ),
    "ids shape": (lambda m: BatchMetadata.build([[20]], [1], [1], 4), 2, "1-D int tensor of 1"),
}


@pytest.mark.parametrize("case", list(BAD_STEPS))
def test_bad_batches_raise_and_change_nothing(ready, case):
    model, runner = ready
    make_md, n_ids, msg = BAD_STEPS[case]
    md = make_md(model)
    caches = [a.kv_cache.clone() for a in model.attention_layers]
    with pytest.raises(ValueError, match=msg):
        runner(torch.zeros(n_ids, dtype=torch.long), md)
    for a, c in zip(model.attention_layers, caches):
        assert torch.equal(a.kv_cache.view(torch.uint8), c.view(torch.uint8))


def test_configure_kv_after_building_the_runner_is_refused():
    model = build_model("gemma3-tiny", MIXED, num_pages=16, dtype=torch.float32)
    runner = DecodeGraphRunner(model, batch_sizes=(1,), max_context=8, capture=False)
    model.configure_kv(KVCacheConfig(page_size=4))
    model.allocator.append("a", 1)
    with pytest.raises(RuntimeError, match="configure_kv.*Build a new runner"):
        runner(torch.zeros(1, dtype=torch.long), _decode_md(model, ["a"]))


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(batch_sizes=(), max_context=8), "batch_sizes must be positive ints"),
        (dict(batch_sizes=(0, 2), max_context=8), "batch_sizes must be positive ints"),
        (dict(batch_sizes=(2,), max_context=0), "max_context must be a positive int, got 0"),
        (dict(batch_sizes=(2,), max_context=8), "ReferenceKernel.* cannot be captured"),
    ],
)
def test_bad_runner_arguments(kw, msg):
    model = build_model("gemma3-tiny", MIXED, num_pages=16, dtype=torch.float32)
    with pytest.raises(ValueError, match=msg):
        DecodeGraphRunner(model, **kw)


def test_capture_needs_a_cuda_model():
    model = build_model("gemma3-tiny", MIXED, num_pages=16, dtype=torch.float32)
    model.kernel.supports_cuda_graphs = True  # pretend: the device check comes next
    with pytest.raises(ValueError, match="needs the model on a CUDA device, it is on cpu"):
        DecodeGraphRunner(model, batch_sizes=(2,), max_context=8)


def test_xqa_block_table_gather():
    """Under a graph shape XQA's dense block table is one fixed buffer of the shape's width,
    refilled in place (the plain case: test_flashinfer_kernel.py)."""
    tables = [[7, 3, 9], [2], [5, 6]]
    md = BatchMetadata.build(tables, [10, 2, 5], [1, 1, 1], 4)
    kernel = FlashInferKernel()
    shape = GraphShape(3, 5)
    g1 = kernel._xqa_tables(md, shape)
    assert g1.block_tables.tolist() == [[7, 3, 9, 0, 0], [2, 0, 0, 0, 0], [5, 6, 0, 0, 0]]
    assert g1.max_seq_len == 20
    md2 = BatchMetadata.build([[1], [4, 8], [11]], [3, 6, 1], [1, 1, 1], 4)
    g2 = kernel._xqa_tables(md2, shape)
    assert g2.block_tables.data_ptr() == g1.block_tables.data_ptr()
    assert g1.block_tables.tolist() == [[1, 0, 0, 0, 0], [4, 8, 0, 0, 0], [11, 0, 0, 0, 0]]


# -- GPU: real capture on FlashInfer ------------------------------------------------------------

HEAD = dict(head_dim=128, query_pre_attn_scalar=128)  # FlashInfer head sizes: 64, 128, 256


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8_decode", ["tensor_cores", "xqa"])
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
