"""Compile caches never mix configurations (complements test_backend.py, which covers the FX
graph cache across skip configs and a Dynamo recompile when one layer's spec is replaced).

Here: a compiled model follows ``configure_kv`` (scales, skip layers, cache dtype) with a recompile
each time; two live models with different configs compiled in one process, called interleaved;
and Inductor's FX graph cache (on) misses when only the k / v scales change and hits, with the
right numerics, when the first config comes back. Wrong-scale bugs are made visible by scales
that saturate FP8, and by comparing KV cache bytes, which must equal eager's bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from tests.support.passes import AttnQuantModel, qkv
from torch_kvq.attention import PageAllocator, ReferenceKernel, forward_context, registry
from torch_kvq.models import build_model
from torch_kvq.passes import kvq_backend, last_report, make_kvq_backend
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig
from torch_kvq.spec_resolve import resolve_layer_specs

IDS = torch.tensor([5, 7, 9, 11, 2, 40, 3])
GEMMA3 = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])


def cache_bytes(model) -> list[torch.Tensor]:
    return [a.kv_cache.view(torch.uint8).clone() for a in model.attention_layers]


def assert_first_cache_equal(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    """Layer 0's k / v come straight from the embeddings, so compiled and eager store the same
    bytes; a graph quantizing with stale scales would not. (Later layers see inputs that differ by
    the fusions' rounding, and with saturating scales ~15% of their FP8 bytes differ.)"""
    assert torch.equal(got[0], want[0]), f"{what}: layer 0 cache bytes differ from eager"


def prefill(model, fn) -> torch.Tensor:
    """Zero the caches, prefill IDS as one sequence through ``fn``, free the sequence."""
    for attn in model.attention_layers:
        attn.kv_cache.zero_()
    md = model.allocator.build_batch([("s", len(IDS))])
    try:
        with torch.no_grad(), model.forward_context(md):
            return fn(IDS, md.positions)
    finally:
        model.allocator.free("s")


def test_compiled_model_follows_configure_kv() -> None:
    model = build_model(
        "llama-tiny", KVCacheConfig("fp8", page_size=4), num_pages=8, num_hidden_layers=2
    )
    backend = make_kvq_backend(inner="eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    configs = [
        dict(kv_cache_dtype="fp8", default_k_scale=1.0, default_v_scale=1.0),
        dict(kv_cache_dtype="fp8", default_k_scale=1e-3, default_v_scale=2e-3),  # saturates
        dict(kv_cache_dtype="fp8", skip_layers=(0,), kv_scales={1: (0.05, 0.04)}),
        dict(kv_cache_dtype="fp8", default_k_scale=1.0, default_v_scale=1.0),  # the first again
    ]
    eager_logits = []
    for i, cfg in enumerate(configs):
        model.configure_kv(KVCacheConfig(page_size=4, **cfg))
        graphs_before = len(backend.graphs)
        eager = prefill(model, model)
        eager_caches = cache_bytes(model)
        out = prefill(model, compiled)
        if i < 3:  # a new config: Dynamo's guards on the specs must send it to a new graph
            assert len(backend.graphs) > graphs_before, f"config {i}: no recompile"
        else:  # config 0 again: reusing config 0's graph is right (and what Dynamo does)
            assert len(backend.graphs) == graphs_before
        rep = last_report() if i < 3 else next(m.last for m in backend.managers if m.runs)
        quantized = {s.name for s in model.kv_specs if s.is_quantized}
        assert set(rep.layers_fused("dequant+attn")) == quantized, rep.format()
        assert_first_cache_equal(cache_bytes(model), eager_caches, f"config {i}")
        torch.testing.assert_close(out, eager, atol=0.02 * eager.abs().max().item(), rtol=0)
        eager_logits.append(eager)
    # the saturating scales really change the numerics, so a stale graph would have shown
    assert (eager_logits[1] - eager_logits[0]).abs().max() > 10 * 0.02 * eager_logits[0].abs().max()


def test_two_live_models_with_different_configs_interleaved() -> None:
    cfg_a = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=4)
    cfg_b = KVCacheConfig("fp8", default_k_scale=1e-3, page_size=4)  # all FP8, k saturates
    a = build_model("gemma3-tiny", cfg_a, num_pages=8, **GEMMA3)
    b = build_model("gemma3-tiny", cfg_b, num_pages=8, **GEMMA3)
    assert a.prefix != b.prefix
    backend = make_kvq_backend(inner="eager")
    compiled = {m.prefix: torch.compile(m, backend=backend, fullgraph=True) for m in (a, b)}
    # a prefill of "s", then a chunk of "s" with a new sequence "t": 7 tokens each, one graph
    steps = [([("s", 7)], IDS), ([("s", 3), ("t", 4)], torch.tensor([17, 4, 8, 30, 31, 1, 9]))]

    def step(model, fn, requests, ids) -> torch.Tensor:
        md = model.allocator.build_batch(requests)
        with torch.no_grad(), model.forward_context(md):
            return fn(ids, md.positions)

    eager = {}
    for m in (a, b):
        eager[m.prefix] = ([step(m, m, *s) for s in steps], cache_bytes(m))
        m.allocator = PageAllocator(m.num_pages, m.kv_config.page_size)  # same pages again
        for attn in m.attention_layers:
            attn.kv_cache.zero_()
    got: dict[str, list[torch.Tensor]] = {a.prefix: [], b.prefix: []}
    for s in steps:  # interleaved: a, b, a, b
        for m in (a, b):
            got[m.prefix].append(step(m, compiled[m.prefix], *s))
    for m in (a, b):
        outs, caches = eager[m.prefix]
        for c, e in zip(got[m.prefix], outs):
            torch.testing.assert_close(c, e, atol=0.02 * e.abs().max().item(), rtol=0)
        assert_first_cache_equal(cache_bytes(m), caches, f"model {m.prefix}")
    # one graph per model, each holding the layers of that model only (a manager that never ran
    # is Dynamo restarting its analysis to specialize a float scale, not a compiled graph)
    reports = [m.last for m in backend.managers if m.runs]
    owners = [{name.split(".", 1)[0] for name in rep.layers} for rep in reports]
    assert sorted(map(sorted, owners)) == sorted([[a.prefix], [b.prefix]])
    for m in (a, b):
        rep = reports[owners.index({m.prefix})]
        quantized = {s.name for s in m.kv_specs if s.is_quantized}
        assert set(rep.layers_fused("quant+write")) == quantized, rep.format()


def _fixed_name_model(k_scale: float, v_scale: float) -> AttnQuantModel:
    infos = [AttentionLayerInfo("fxs.layers.0.attn", 8, 2, 32)]
    cfg = KVCacheConfig("fp8", page_size=16, default_k_scale=k_scale, default_v_scale=v_scale)
    return AttnQuantModel(resolve_layer_specs(cfg, infos, torch.bfloat16), 4, "op")


def test_fx_graph_cache_misses_when_only_the_scales_change() -> None:
    from torch._inductor.utils import fresh_inductor_cache

    md = PageAllocator(4, 16).build_batch([(0, 5), (1, 2)])
    x = qkv(7, (8, 2), 32, torch.bfloat16)
    results = {}
    counters.clear()
    with fresh_inductor_cache(), torch._inductor.config.patch(fx_graph_cache=True):
        with torch._functorch.config.patch(enable_autograd_cache=False), torch.no_grad():
            for key, scales in (
                ("A", (0.02, 0.03)),
                ("B", (1e-3, 2e-3)),
                ("A again", (0.02, 0.03)),
            ):
                torch._dynamo.reset()
                model = _fixed_name_model(*scales)
                with forward_context(md, model.specs, ReferenceKernel()):
                    eager = model(*x)
                    eager_cache = model.layers[0].kv_cache.view(torch.uint8).clone()
                    model.layers[0].kv_cache.zero_()
                    out = torch.compile(model, backend=kvq_backend)(*x)
                rep = last_report()
                results[key] = (
                    counters["inductor"]["fxgraph_cache_miss"],
                    counters["inductor"]["fxgraph_cache_hit"],
                    rep.source,
                )
                assert torch.equal(model.layers[0].kv_cache.view(torch.uint8), eager_cache), key
                o, e = out[0].float(), eager[0].float()  # FP8 o_proj inputs
                assert ((o - e).abs() > 0.07 * e.abs().max() + 2**-6).float().mean() < 0.01, key
                results[key] += (eager_cache,)
                registry.unregister(model.layers[0])
    assert results["A"][:3] == (1, 0, "passes")
    assert results["B"][:3] == (2, 0, "passes")  # same graph shape and names, other scales: a miss
    assert results["A again"][:3] == (2, 1, "fx graph cache hit")
    assert not torch.equal(results["A"][3], results["B"][3])  # the scales changed what was stored


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
