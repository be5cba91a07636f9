"""The model API others build on: names, prefixes, configure_kv, weights, kernels, compile."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from torch_kvq import KVCacheConfig
from torch_kvq.attention import ReferenceKernel, registry
from torch_kvq.models import Gemma3Model, LlamaModel, build_model, generate, tiny_gemma3_config
from torch_kvq.spec_modes import FP8_DTYPE, KVQuantMode

KV = KVCacheConfig(page_size=4)
PROMPTS = [[1, 2, 3, 4, 5], [7] * 11, [9, 8]]


def test_layer_names_and_unique_prefixes():
    a, b = build_model("gemma3-tiny", KV), build_model("gemma3-tiny", KV)
    assert a.prefix != b.prefix
    for m in (a, b):
        names = [s.name for s in m.kv_specs]
        assert names == [f"{m.prefix}.layers.{i}.self_attn.attn" for i in range(6)]
        assert [x.layer_name for x in m.attention_layers] == names
        assert all(registry.lookup(n) is s for n, s in zip(names, m.kv_specs))
        assert (
            dict(m.named_modules())[names[0].removeprefix(m.prefix + ".")] is m.attention_layers[0]
        )
    named = build_model("llama-tiny", KV, prefix="draft")
    assert named.kv_specs[0].name == "draft.layers.0.self_attn.attn"
    with pytest.raises(ValueError, match="already used by another live layer"):
        build_model("llama-tiny", KV, prefix="draft")


def test_configure_kv_replaces_caches_and_specs():
    m = build_model("gemma3-tiny", KV)
    old = m.attention_layers  # still referenced: must not block re-registration
    old_alloc = m.allocator
    m.configure_kv(
        KVCacheConfig(kv_cache_dtype="fp8", skip_layers=("sliding_window",), page_size=8)
    )
    new = m.attention_layers
    assert all(o is not n for o, n in zip(old, new))
    assert m.allocator is not old_alloc and m.allocator.page_size == 8
    for spec, layer in zip(m.kv_specs, new):
        assert registry.lookup(spec.name) is spec is layer.spec
        assert layer.kv_cache.dtype == (
            FP8_DTYPE if spec.sliding_window is None else torch.bfloat16
        )
        assert layer.kv_cache.shape[2] == 8
    assert [s.mode for s in m.kv_specs].count(KVQuantMode.FP8_PER_TENSOR) == 2
    assert len(generate(m, PROMPTS, 2).tokens) == 3


def test_configure_kv_bad_config_changes_nothing():
    m = build_model("llama-tiny", KV)
    specs, layers = m.kv_specs, m.attention_layers
    with pytest.raises(ValueError, match="skip_layers index 9 is out of range"):
        m.configure_kv(KVCacheConfig(kv_cache_dtype="fp8", skip_layers=(9,)))
    assert m.kv_specs is specs and m.attention_layers == layers


def test_load_hf_state_dict_round_trip_and_errors():
    src, dst = build_model("gemma3-tiny", KV, seed=1), build_model("gemma3-tiny", KV, seed=2)
    hf_style = {f"model.{k}": v for k, v in src.state_dict().items()}
    hf_style["lm_head.weight"] = hf_style["model.embed_tokens.weight"]  # tied, as HF lists it
    dst.load_hf_state_dict(hf_style)
    assert torch.equal(generate(src, PROMPTS, 3).logits, generate(dst, PROMPTS, 3).logits)
    missing = {k: v for k, v in hf_style.items() if "q_norm" not in k}
    with pytest.raises(ValueError, match=r"missing \['layers.0.self_attn.q_norm.weight'"):
        dst.load_hf_state_dict(missing)
    with pytest.raises(ValueError, match=r"unexpected \['bogus.weight'\]"):
        dst.load_hf_state_dict({**hf_style, "model.bogus.weight": torch.zeros(1)})
    bad = {**hf_style, "model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"norm.weight: shape \(3,\), expected \(128,\)"):
        dst.load_hf_state_dict(bad)


def test_build_model_is_deterministic_and_checks_its_args():
    a, b, c = (build_model("llama-tiny", KV, seed=s) for s in (0, 0, 1))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(
        sa["layers.0.self_attn.q_proj.weight"], sc["layers.0.self_attn.q_proj.weight"]
    )
    assert len(build_model("gemma3-tiny", KV, num_hidden_layers=3, layer_types=None).layers) == 3
    with pytest.raises(ValueError, match=r"unknown preset 'gpt'; expected one of \['gemma3-tiny'"):
        build_model("gpt", KV)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": torch.int8}, "dtype torch.int8 unsupported"),
        ({"num_pages": 0}, "num_pages must be a positive int, got 0"),
        ({"quant_form": "triton"}, "quant_form 'triton' unknown"),
        ({"prefix": ""}, "prefix must be a non-empty string"),
    ],
)
def test_constructor_rejects_bad_args(kwargs, message):
    args = {"num_pages": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        Gemma3Model(tiny_gemma3_config(), KV, args.pop("num_pages"), **args)


def test_forward_checks_shapes_and_needs_a_context():
    m = build_model("llama-tiny", KV)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"expected input_ids \[T\] and positions \[T\]"):
        m(ids[None], torch.arange(3)[None])
    with pytest.raises(RuntimeError, match="no kvq forward context is set"):
        m(ids, torch.arange(3))


@pytest.mark.parametrize("name", ["llama-tiny", "gemma3-tiny"])
def test_logits_indices_give_those_rows_of_the_full_logits(name):
    """A prefill that needs only each prompt's last token skips the [T, vocab] head."""
    outs = []
    for rows in (None, torch.tensor([4, 9])):
        m = build_model(name, KV)
        md = m.allocator.build_batch([(0, 5), (1, 5)])
        ids = torch.arange(10) % 7 + 1
        with m.forward_context(md):
            outs.append(m(ids, md.positions, rows) if rows is not None else m(ids, md.positions))
    full, last = outs
    assert full.shape[0] == 10 and last.shape == (2, full.shape[1])
    torch.testing.assert_close(last, full[[4, 9]], rtol=1e-5, atol=1e-5)


class RecordingKernel(ReferenceKernel):
    def __init__(self) -> None:
        self.planned: list[tuple[str, ...]] = []

    def plan(self, ctx, specs) -> None:
        self.planned.append(tuple(s.name for s in specs))


def test_kernel_is_planned_once_per_step_for_every_layer():
    k = RecordingKernel()
    m = build_model("llama-tiny", KV, kernel=k)
    generate(m, PROMPTS, 3)
    assert k.planned == [tuple(s.name for s in m.kv_specs)] * 3


def test_quant_forms_agree_and_model_compiles_without_graph_breaks():
    kv8 = KVCacheConfig(kv_cache_dtype="fp8", skip_layers=("sliding_window",), page_size=4)
    op, tf = build_model("gemma3-tiny", kv8), build_model("gemma3-tiny", kv8, quant_form="torch")
    ref = generate(op, PROMPTS, 3)
    assert torch.equal(ref.logits, generate(tf, PROMPTS, 3).logits)
    # Not fullgraph=True: that mode constant-folds some things a default compile breaks on.
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(op, backend="eager")
    assert torch.equal(ref.logits, generate(op, PROMPTS, 3, forward=compiled).logits)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1


def test_llama_untied_head_and_gemma_tied_head():
    assert build_model("llama-tiny", KV).lm_head is not None
    g = build_model("gemma3-tiny", KV)
    assert g.lm_head is None and "lm_head.weight" not in g.state_dict()
    assert isinstance(build_model("llama-tiny", KV), LlamaModel)
