"""kvq_backend / make_kvq_backend: layers found in the Dynamo graph, Inductor hand-off, FX graph
cache keyed by the spec table, recompiles on spec change, prefill then decode."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from tests.support.passes import (
    DETERMINISTIC,
    AttnQuantModel,
    caches,
    fill_caches,
    make_specs,
    no_compile_caches,
    qkv,
    restore,
    small_case,
)
from torch_kvq import kvq_backend, make_kvq_backend
from torch_kvq.attention import PageAllocator, ReferenceKernel, forward_context, registry
from torch_kvq.attention.kernels.capabilities import register_capabilities
from torch_kvq.passes import DEFAULT_PASSES, KVQPass, last_report
from torch_kvq.passes.backend import graph_layers
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig
from torch_kvq.spec_modes import KVQuantMode
from torch_kvq.spec_resolve import resolve_layer_specs


def assert_fp8_close(compiled, eager):
    """Within one FP8 step plus 2**-7 of the largest value (see test_fusion_attn's docstring)."""
    for c, e in zip(compiled, eager):
        c, e = c.float(), e.float()
        m = torch.maximum(c.abs(), e.abs())
        step = torch.where(
            m >= 2**-6, torch.exp2(torch.floor(torch.log2(m.clamp_min(2**-6))) - 3), 2**-9
        )
        assert ((c - e).abs() <= step + 2**-7 * e.abs().max()).all()


class NamedKernel(ReferenceKernel):
    """The reference kernel under another capability-table name."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_graph_layers_finds_every_layer_and_its_device():
    model, md, inputs = small_case("op")
    seen = []

    def spy(gm, example_inputs):
        seen.append(graph_layers(gm))
        return gm

    with torch.no_grad(), forward_context(md, model.specs, ReferenceKernel()):
        torch.compile(model, backend=spy, fullgraph=True)(*inputs)
    assert seen == [{s.name: torch.device("cpu") for s in model.specs}]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"inner": "tvm"},
            r"inner compiler 'tvm' unknown; expected one of \('inductor', 'eager'\)",
        ),
        ({"passes": ["annotate", "nope"]}, r"unknown passes \['nope'\]"),
        (
            {"config_patches": {"post_grad_custom_post_pass": None}},
            r"may not set post_grad_custom_post_pass",
        ),
    ],
)
def test_make_kvq_backend_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_kvq_backend(**kwargs)


def test_kvq_backend_inductor_prefill_then_decode():
    """The default backend (Inductor), one prefill step then one decode step (a recompile with a
    dynamic token count): outputs match eager, the caches match, and the report is per layer."""
    specs = make_specs(3, "fp8", skip=(1,))
    model = AttnQuantModel(specs, 8, "torch")
    alloc = PageAllocator(8, 16)
    steps = [alloc.build_batch([(0, 5), (1, 3)]), alloc.build_batch([(0, 1), (1, 1)])]
    inputs = [qkv(md.num_tokens, (8, 2), 32, torch.bfloat16, seed=i) for i, md in enumerate(steps)]
    kernel = ReferenceKernel()
    with torch.no_grad():
        eager = []
        for md, x in zip(steps, inputs):
            with forward_context(md, specs, kernel):
                eager.append(model(*x))
        eager_caches = caches(model)
        for c in model.layers:
            c.kv_cache.zero_()
        compiled_fn = torch.compile(model, backend=kvq_backend)
        with no_compile_caches():
            for i, (md, x) in enumerate(zip(steps, inputs)):
                with forward_context(md, specs, kernel):
                    assert_fp8_close(compiled_fn(*x), eager[i])
                rep = last_report()
                assert rep.source == "passes"
                assert rep.layers_fused("output quant") == (specs[0].name, specs[2].name)
    for c, e in zip(caches(model), eager_caches):
        assert torch.equal(c.view(torch.uint8), e.view(torch.uint8))


class _SeesDeterministic(KVQPass):
    """Records Inductor's ``deterministic`` flag each time a compile runs the passes."""

    name = "sees_deterministic"

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def __call__(self, graph, ctx) -> int:
        self.seen.append(bool(torch._inductor.config.deterministic))
        return 0

    def uuid(self) -> str:
        return self.name


def test_config_patches_hold_in_every_compile_of_the_backend():
    """``config_patches`` apply inside every compile the backend makes: two models compiled one
    after the other (the second a recompile of the same forward) both see Inductor's
    ``deterministic`` mode. A process-wide ``torch._inductor.config.patch`` does not hold that
    long (Dynamo restores ``torch.use_deterministic_algorithms`` after each trace, which also
    sets that flag: docs/contributing.md, Determinism)."""
    spy = _SeesDeterministic()
    backend = make_kvq_backend(passes=[*DEFAULT_PASSES, spy], config_patches=DETERMINISTIC)
    with no_compile_caches(), torch.no_grad():
        for _ in range(2):
            model, md, inputs = small_case("op")
            with forward_context(md, model.specs, ReferenceKernel()):
                torch.compile(model, backend=backend)(*inputs)
    assert spy.seen == [True, True]


def test_unknown_layer_fails_the_compile():
    model, md, inputs = small_case("op")
    gone = model.layers[0]
    with torch.no_grad(), forward_context(md, model.specs, ReferenceKernel()):
        registry.unregister(gone)
        try:
            with pytest.raises(
                Exception, match=rf"attention layer '{gone.layer_name}'.*unknown attention layer"
            ):
                torch.compile(model, backend=make_kvq_backend(inner="eager"))(*inputs)
        finally:
            registry.register(gone)


def test_kernel_comes_from_the_forward_context_unless_given():
    register_capabilities("test-bf16-only", "cpu", [(KVQuantMode.NONE, torch.bfloat16, False)])
    model, md, inputs = small_case("op")
    for given, expect_fused in ((None, False), ("reference", True)):
        torch._dynamo.reset()
        backend = make_kvq_backend(inner="eager", kernel=given)
        with torch.no_grad(), forward_context(md, model.specs, NamedKernel("test-bf16-only")):
            torch.compile(model, backend=backend)(*inputs)
        rep = backend.managers[-1].last
        assert {info["kernel"] for info in rep.layers.values()} == {given or "test-bf16-only"}
        assert bool(rep.layers_fused("dequant+attn")) is expect_fused


def test_foreign_post_grad_pass_is_not_silently_replaced():
    model, md, inputs = small_case("op")

    def other_pass(graph):
        return None

    with torch._inductor.config.patch(post_grad_custom_post_pass=other_pass):
        with torch.no_grad(), forward_context(md, model.specs, ReferenceKernel()):
            with pytest.raises(Exception, match=r"post_grad_custom_post_pass is already set"):
                torch.compile(model, backend=kvq_backend)(*inputs)


def _named_model(skip):
    """Two layers with fixed names (layer 0 sliding) and a skip config."""
    infos = [
        AttentionLayerInfo("fxc.layers.0.attn", 8, 2, 32, sliding_window=8),
        AttentionLayerInfo("fxc.layers.1.attn", 8, 2, 32),
    ]
    specs = resolve_layer_specs(
        KVCacheConfig("fp8", skip_layers=skip, page_size=16), infos, torch.bfloat16
    )
    return AttnQuantModel(specs, 8, "op")


def test_fx_graph_cache_never_reuses_a_graph_compiled_for_another_skip_config():
    from torch._inductor.utils import fresh_inductor_cache

    alloc = PageAllocator(8, 16)
    md = alloc.build_batch([(0, 5), (1, 2)])
    x = qkv(7, (8, 2), 32, torch.bfloat16)
    counters.clear()
    results = {}
    with fresh_inductor_cache(), torch._inductor.config.patch(fx_graph_cache=True):
        with torch._functorch.config.patch(enable_autograd_cache=False), torch.no_grad():
            for key, skip in (
                ("A", (0,)),
                ("B", (1,)),
                ("C", ("sliding_window",)),
                ("A again", (0,)),
            ):
                torch._dynamo.reset()
                model = _named_model(skip)
                with forward_context(md, model.specs, ReferenceKernel()):
                    torch.compile(model, backend=kvq_backend)(*x)
                rep = last_report()
                results[key] = (
                    counters["inductor"]["fxgraph_cache_miss"],
                    counters["inductor"]["fxgraph_cache_hit"],
                    rep.layers_fused("dequant+attn"),
                    rep.source,
                )
                for layer in model.layers:
                    registry.unregister(layer)
    names = ("fxc.layers.0.attn", "fxc.layers.1.attn")
    assert results["A"] == (1, 0, (names[1],), "passes")
    assert results["B"] == (
        2,
        0,
        (names[0],),
        "passes",
    )  # another skip config: a miss, fused differently
    # C skips the same layer as A by another rule: the same graph, another spec table -> a miss
    assert results["C"] == (3, 0, (names[1],), "passes")
    # the cache is on and the key is stable: A again is a hit, reported as A was
    assert results["A again"] == (3, 1, (names[1],), "fx graph cache hit")


def test_dynamo_recompiles_when_a_layers_spec_changes():
    specs = make_specs(1, "fp8")
    model = AttnQuantModel(specs, 8, "op")
    alloc = PageAllocator(8, 16)
    md = alloc.build_batch([(0, 6)])
    x = qkv(6, (8, 2), 32, torch.bfloat16)
    backend = make_kvq_backend(inner="eager")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        with forward_context(md, specs, ReferenceKernel()):
            compiled(*x)
        assert len(backend.managers) == 1 and backend.managers[0].last.layers_fused("dequant+attn")
        attn = model.layers[0]
        bf16 = dataclasses.replace(
            attn.spec, mode=KVQuantMode.NONE, storage_dtype=torch.bfloat16, k_scale=1.0, v_scale=1.0
        )
        attn.spec = bf16
        attn.kv_cache = torch.zeros(attn.kv_cache.shape, dtype=torch.bfloat16)
        fill_caches(model)
        saved = caches(model)
        with forward_context(md, [bf16], ReferenceKernel()):
            eager = model(*x)
            restore(model, saved)
            out = compiled(*x)
    assert len(backend.managers) == 2  # Dynamo's guards saw the new spec and recompiled
    rep = backend.managers[-1].last
    assert rep.layers_fused("dequant+attn") == ()
    assert (
        rep.per_layer[bf16.name]["fuse_dequant_attention"] == "kept bf16 (not quantized: mode none)"
    )
    assert_fp8_close(out, eager)


# -- which kernel: given (object, name, mapping), else the forward context's, never guessed ------


@pytest.mark.parametrize(
    "kernel,match",
    [
        (123, r"kernel must be an attention kernel \(an AttentionKernel such as .*got 123"),
        ("flashinfer-fast", r"kernel 'flashinfer-fast': unknown kernel 'flashinfer-fast'; the"),
        ({"a.attn": 1.5}, r"kernel for layer 'a.attn' must be an attention kernel.*got 1.5"),
        (NamedKernel("not-in-table"), r"unknown kernel 'not-in-table'; the capability table"),
        (object(), r"kernel must be an attention kernel"),
    ],
)
def test_make_kvq_backend_refuses_what_is_not_a_kernel(kernel, match):
    with pytest.raises(ValueError, match=match):
        make_kvq_backend(kernel=kernel)


def test_kernel_objects_and_names_are_accepted():
    from torch_kvq.attention.kernels import FlashInferKernel

    xqa = FlashInferKernel(fp8_decode="xqa", phases="decode")
    assert make_kvq_backend(kernel=xqa).kernel_names == "flashinfer-xqa-decode"
    assert make_kvq_backend(kernel="flashinfer").kernel_names == "flashinfer"
    both = make_kvq_backend(kernel={"a": ReferenceKernel(), "b": "flashinfer-decode"})
    assert both.kernel_names == {"a": "reference", "b": "flashinfer-decode"}


@pytest.mark.parametrize(
    "fp8_decode,phases,output_quant",
    [
        ("xqa", "decode", True),
        ("xqa", "any", False),
        ("tensor_cores", "decode", False),
        ("triton", "decode", False),
    ],
)
def test_a_kernel_object_brings_its_capabilities(monkeypatch, fp8_decode, phases, output_quant):
    """make_kvq_backend(kernel=FlashInferKernel(...)) stamps the layers with that configuration's
    row: on sm90 only the decode-only XQA kernel claims (and gets) the output-quant fusion. The
    arch is pretended; the graph runs on the CPU with the reference kernel."""
    from torch_kvq.attention.kernels import FlashInferKernel
    from torch_kvq.attention.kernels import capabilities as caps

    monkeypatch.setattr(caps, "device_arch", lambda device: "sm90")
    specs = make_specs(2, "fp8", head_size=64)
    model = AttnQuantModel(specs, 8, "op")
    md = PageAllocator(8, 16).build_batch([(0, 3)])
    kernel = FlashInferKernel(fp8_decode=fp8_decode, phases=phases)
    backend = make_kvq_backend(inner="eager", kernel=kernel)
    torch._dynamo.reset()
    with torch.no_grad(), forward_context(md, specs, ReferenceKernel()):
        torch.compile(model, backend=backend)(*qkv(3, (8, 2), 64, torch.bfloat16))
    rep = backend.managers[-1].last
    assert {info["kernel"] for info in rep.layers.values()} == {kernel.name}
    assert {info["arch"] for info in rep.layers.values()} == {"sm90"}
    assert rep.layers_fused("dequant+attn") == tuple(s.name for s in specs)
    assert rep.layers_fused("output quant") == (
        tuple(s.name for s in specs) if output_quant else ()
    )


def test_no_kernel_and_no_forward_context_is_an_error():
    model, md, inputs = small_case("op")
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception) as info:
        torch.compile(model, backend=make_kvq_backend(inner="eager"))(*inputs)
    msg = str(info.value)
    assert f"no kernel for attention layer '{model.specs[0].name}'" in msg
    assert "no forward context is active" in msg
    assert "make_kvq_backend(kernel=...)" in msg and "inside forward_context(...)" in msg
    torch._dynamo.reset()
    with torch.no_grad(), forward_context(md, model.specs[:1], ReferenceKernel()):
        with pytest.raises(Exception, match=r"the active forward context has no kernel for it"):
            torch.compile(model, backend=make_kvq_backend(inner="eager"))(*inputs)
    torch._dynamo.reset()
    backend = make_kvq_backend(inner="eager", kernel="reference")  # given: compiles without one
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"no kvq forward context is set"):
        torch.compile(model, backend=backend)(*inputs)  # (running the ops still needs one)
    assert backend.managers[-1].last.layers_fused("dequant+attn")


def test_report_memo_is_bounded(monkeypatch, tmp_path):
    """The in-process memo of pass reports keeps the newest MEMO_SIZE entries (not one per
    compiled graph forever); the copies beside the cache are still written."""
    from torch_kvq.passes import backend as be
    from torch_kvq.passes import report

    monkeypatch.setattr(be, "_memo", type(be._memo)())
    monkeypatch.setattr(be, "_memo_file", lambda key: tmp_path / f"{key}.json")
    rep = report.GraphReport(-1, {}, {}, {}, {}, 0.0)
    for i in range(be.MEMO_SIZE + 5):
        be._remember(f"k{i}", rep)
    assert len(be._memo) == be.MEMO_SIZE
    assert "k0" not in be._memo and f"k{be.MEMO_SIZE + 4}" in be._memo
    assert len(list(tmp_path.iterdir())) == be.MEMO_SIZE + 5
