"""Static FP8 quants whose scale is a tensor (a registered buffer, the form vLLM's
test_fusion_attn.py uses for the o_proj input quant, and vLLM's ``layer._k_scale``): fused like a
Python-float scale, for k / v (``kvq.quant_cache_write_ts``) and for the attention output
(``paged_attention_fp8(..., output_scale_tensor=)``), with the tensor kept a graph input read at
run time. Changing the buffer in place changes what the compiled model computes, without a
recompile, and Inductor's FX graph cache never serves a graph holding an old value.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from tests.support.passes import (
    OUT_SCALE,
    batch_plan,
    capture_graph,
    check_close,
    make_batch,
    make_specs,
    nodes_of,
    pages_for,
    qkv,
    run_passes,
)
from torch_kvq.attention import Attention, ReferenceKernel, forward_context, registry
from torch_kvq.attention.kernels.capabilities import register_capabilities
from torch_kvq.attention.quant import FP8_MAX
from torch_kvq.passes import DEFAULT_PASSES, make_kvq_backend
from torch_kvq.passes.graph_utils import (
    ATTENTION_FP8,
    CACHE_WRITE,
    QUANT_CACHE_WRITE,
    QUANT_CACHE_WRITE_TS,
    op_args,
)
from torch_kvq.spec_modes import KVQuantMode

TOL = dict(atol=2**-5, rtol=0.15)  # FP8 e4m3 rounding of both sides


def tensor_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


class BufferScaleLayer(nn.Module):
    """One FP8 layer whose k / v quants (``kv="tensor"``) and o_proj input quant
    (``out="tensor"``) divide by registered 0-d float32 buffers (``"float"``: a Python float)."""

    def __init__(self, spec, num_pages, kv="tensor", out="tensor", v_kv=None, param=False):
        super().__init__()
        self.attn = Attention(spec, num_pages)
        self.kv, self.v_kv, self.out = kv, v_kv or kv, out
        for name, value in (
            ("k_scale", spec.k_scale),
            ("v_scale", spec.v_scale),
            ("out_scale", OUT_SCALE),
        ):
            t = torch.tensor(value, dtype=torch.float32)
            if param:
                setattr(self, name, nn.Parameter(t, requires_grad=False))
            else:
                self.register_buffer(name, t)

    @property
    def specs(self):
        return [self.attn.spec]

    def forward(self, q, k, v):
        s = self.attn.spec
        kq = tensor_quant(k, self.k_scale) if self.kv == "tensor" else tensor_quant(k, s.k_scale)
        vq = tensor_quant(v, self.v_scale) if self.v_kv == "tensor" else tensor_quant(v, s.v_scale)
        torch.ops.kvq.cache_write(kq, vq, self.attn.kv_cache, s.name)
        kv = torch.ops.kvq.dequantize_kv_cache(
            self.attn.kv_cache, s.k_scale, s.v_scale, torch.float32, s.name
        )
        o = torch.ops.kvq.paged_attention(q, kv, s.name)
        x = o.reshape(o.shape[0], -1)
        return tensor_quant(x, self.out_scale if self.out == "tensor" else OUT_SCALE)


def case(num_tokens=7, device="cpu", **kw):
    (spec,) = make_specs(1, "fp8")
    plan = batch_plan(num_tokens)
    num_pages = pages_for(plan)
    model = BufferScaleLayer(spec, num_pages, **kw).to(device)
    md = make_batch(plan, num_pages)
    if device != "cpu":
        md = type(md).build(md.page_tables, md.kv_lens, md.qo_lens, md.page_size, device=device)
    inputs = tuple(t.to(device) for t in qkv(num_tokens, (8, 2), 32, torch.bfloat16))
    return model, md, inputs


GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton write)"),
]


def placeholder_of(gm, model, name):
    """The graph input holding ``model.<name>`` (matched by identity of the fake's value)."""
    target = getattr(model, name)
    found = [
        n
        for n in gm.graph.find_nodes(op="placeholder")
        if isinstance(n.meta.get("val"), torch.Tensor)
        and n.meta["val"].shape == target.shape
        and n.meta["val"].dtype == torch.float32
        and n.meta["val"].dim() == 0
    ]
    return found


# ---- the passes on the captured graph ------------------------------------------------------


@pytest.mark.parametrize("param", [False, True], ids=["buffer", "parameter"])
def test_tensor_scales_fused_as_graph_inputs(param):
    model, md, inputs = case(param=param)
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, DEFAULT_PASSES)
    scale_inputs = placeholder_of(gm, model, "k_scale")
    assert len(scale_inputs) == 3  # k, v and output scales: graph inputs, not constants
    (write,) = nodes_of(gm, QUANT_CACHE_WRITE_TS)
    assert write.kwargs["k_scale"] in scale_inputs and write.kwargs["v_scale"] in scale_inputs
    assert write.kwargs["k_scale"] is not write.kwargs["v_scale"]
    assert write.kwargs["k"].op == "placeholder"  # the bf16 k itself
    assert not nodes_of(gm, CACHE_WRITE) and not nodes_of(gm, QUANT_CACHE_WRITE)
    (attn,) = nodes_of(gm, ATTENTION_FP8)
    args = op_args(attn)
    assert args.get("output_scale") is None
    assert args["output_scale_tensor"] in scale_inputs
    assert manager.last.fused(model.specs[0].name) == (
        "quant+write",
        "dequant+attn",
        "output quant",
    )
    counts = manager.last.ops_after
    assert counts.get("fp8_cast", 0) == 0 and counts.get("output_scale") == 1


def test_mixed_float_and_tensor_kv_scales_are_left_with_a_true_reason():
    model, md, inputs = case(kv="float", v_kv="tensor")
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, DEFAULT_PASSES)
    assert len(nodes_of(gm, CACHE_WRITE)) == 1
    decision = manager.last.per_layer[model.specs[0].name]["fuse_quant_cache_write"]
    assert decision == (
        "not fused: v's quant scale is a tensor and the other's a Python number; the fused "
        "write takes both as numbers or both as tensors"
    )
    # the attention and its tensor-scale output quant are fused all the same
    (attn,) = nodes_of(gm, ATTENTION_FP8)
    assert op_args(attn)["output_scale_tensor"] is not None


def _with_buffers(model, shape=(), dtype=torch.float32):
    for name in ("k_scale", "v_scale", "out_scale"):
        model.register_buffer(name, getattr(model, name).reshape(shape).to(dtype).clone())
    return model


def test_one_element_scale_of_any_rank_is_fused():
    model, md, inputs = case()
    _with_buffers(model, (1, 1))
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, DEFAULT_PASSES)
    assert manager.last.fused(model.specs[0].name) == (
        "quant+write",
        "dequant+attn",
        "output quant",
    )


def _mul_quant(x, scale):
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


@pytest.mark.parametrize(
    "what,dtype,quant,reason",
    [
        (
            "bf16 buffer",
            torch.bfloat16,
            tensor_quant,
            "is not a static FP8 quant the passes fuse (it divides by a bf16 tensor of shape () "
            "({arg}); a run-time scale must be a float32 tensor of one element)",
        ),
        (
            "x * (1 / buffer)",
            torch.float32,
            _mul_quant,
            "is not a static FP8 quant the passes fuse (it multiplies by a tensor; a tensor "
            "scale is fused only as x / scale)",
        ),
    ],
)
def test_unfused_tensor_scale_forms_say_why(monkeypatch, what, dtype, quant, reason):
    monkeypatch.setattr(sys.modules[__name__], "tensor_quant", quant)
    model, md, inputs = case()
    _with_buffers(model, (), dtype)
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, DEFAULT_PASSES)
    decisions = manager.last.per_layer[model.specs[0].name]
    args = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    write = decisions["fuse_quant_cache_write"]
    assert write == "not fused: k " + reason.format(arg=args[0]), write
    out = decisions["fuse_attention_output_quant"]
    assert out == "not fused: the attention output's FP8 quant " + reason.format(arg=args[-1]), out
    assert len(nodes_of(gm, CACHE_WRITE)) == 1


def test_kv_quotient_in_bf16_is_not_fused(monkeypatch):
    """``k / scale_tensor`` on a bf16 k rounds the quotient to bf16 first; the fused write divides
    in fp32 and would write other bytes, so it is left unfused, saying so."""

    def bf16_quant(x, scale):
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    monkeypatch.setattr(sys.modules[__name__], "tensor_quant", bf16_quant)
    model, md, inputs = case()
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, DEFAULT_PASSES)
    decision = manager.last.per_layer[model.specs[0].name]["fuse_quant_cache_write"]
    assert decision == (
        "not fused: k divides a bf16 value by its scale tensor (the quotient is rounded to bf16 "
        "before the FP8 cast), and the fused write divides in fp32, so it would not write the "
        "same bytes; quantize x.float() / scale"
    )
    assert len(nodes_of(gm, CACHE_WRITE)) == 1


def test_kernel_without_tensor_output_scale_leaves_the_output_quant():
    """A kernel that writes FP8 output with a float scale only (FlashInfer's XQA): k / v still
    fuse, the tensor-scale output quant stays, and the decision says why."""
    combos = [
        (KVQuantMode.NONE, torch.bfloat16, False),
        (KVQuantMode.FP8_PER_TENSOR, torch.bfloat16, False),
        (KVQuantMode.FP8_PER_TENSOR, torch.bfloat16, True),
    ]
    register_capabilities("test-float-oscale", "cpu", combos)
    model, md, inputs = case()
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, DEFAULT_PASSES, kernel="test-float-oscale")
    (attn,) = nodes_of(gm, ATTENTION_FP8)
    assert op_args(attn).get("output_scale_tensor") is None
    assert manager.last.ops_after.get("fp8_cast", 0) == 1
    assert len(nodes_of(gm, QUANT_CACHE_WRITE_TS)) == 1
    decision = manager.last.per_layer[model.specs[0].name]["fuse_attention_output_quant"]
    assert decision == (
        "not fused: the output quant's scale is a tensor, and kernel 'test-float-oscale' on cpu "
        "takes the FP8 output scale only as a Python float"
    )
    # the same kernel fuses a float-scale output quant
    model, md, inputs = case(out="float")
    gm = capture_graph(model, inputs, md)
    run_passes(gm, model.specs, DEFAULT_PASSES, kernel="test-float-oscale")
    (attn,) = nodes_of(gm, ATTENTION_FP8)
    assert op_args(attn)["output_scale"] == pytest.approx(OUT_SCALE)


def test_flashinfer_rows_never_claim_a_tensor_output_scale():
    from torch_kvq.attention.kernels.capabilities import supports_tensor_output_scale
    from torch_kvq.passes import make_stamp

    assert supports_tensor_output_scale("reference", "cpu")
    (spec,) = make_specs(1, "fp8", head_size=128)
    stamp = make_stamp(spec, "flashinfer-xqa-decode", "sm90")
    assert stamp.fp8_output and not stamp.fp8_output_tensor_scale
    assert "takes the FP8 output scale only as a Python float" in stamp.output_block(True)
    assert stamp.output_block(False) is None


# ---- end to end: compiled == eager, then the buffers change ---------------------------------


def _eager_and_compiled(model, md, inputs, fn):
    """(eager out, eager cache, compiled out, compiled cache), each from the same starting cache."""
    cache = model.attn.kv_cache
    start = cache.clone()
    with torch.no_grad(), forward_context(md, model.specs, ReferenceKernel()):
        eager = model(*inputs)
        eager_cache = cache.view(torch.uint8).clone()
        cache.copy_(start)
        out = fn(*inputs)
    return eager, eager_cache, out, cache.view(torch.uint8).clone()


def _check(model, md, inputs, fn, what):
    eager, eager_cache, out, out_cache = _eager_and_compiled(model, md, inputs, fn)
    assert torch.equal(out_cache, eager_cache), f"{what}: cache bytes differ from eager"
    check_close(out, eager)
    return eager, eager_cache


@pytest.mark.parametrize(
    "inner,device",
    [
        ("eager", "cpu"),
        ("inductor", "cpu"),
        pytest.param("eager", "cuda", marks=GPU),
        pytest.param("inductor", "cuda", marks=GPU),
    ],
)
def test_compiled_follows_the_buffers_without_recompiling(inner, device):
    """On CUDA the fused write is the Triton kernel loading the scale buffers from the device:
    its cache bytes must equal eager's ``x.float() / buffer`` (aten tensor / tensor division)."""
    model, md, inputs = case(num_tokens=7 if device == "cpu" else 256, device=device)
    backend = make_kvq_backend(inner=inner)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch._inductor.config.patch(fx_graph_cache=False):
        with torch._functorch.config.patch(enable_autograd_cache=False):
            first = _check(model, md, inputs, compiled, "first")
            rep = backend.managers[-1].last
            assert rep.fused(model.specs[0].name) == ("quant+write", "dequant+attn", "output quant")
            model.out_scale.fill_(0.02)
            second = _check(model, md, inputs, compiled, "after out_scale.fill_")
            model.k_scale.fill_(0.005)  # saturates part of k: visible in the cache bytes
            model.v_scale.fill_(0.05)
            third = _check(model, md, inputs, compiled, "after k/v_scale.fill_")
    assert sum(m.runs for m in backend.managers) == 1  # no recompile
    # out_scale 0.01 -> 0.02 halves the FP8 outputs (those below saturation)
    small = first[0].float().abs() < 200
    torch.testing.assert_close(second[0].float()[small], first[0].float()[small] / 2, **TOL)
    assert torch.equal(first[1], second[1])
    assert not torch.equal(second[1], third[1])  # the k / v scales changed the bytes


def test_fx_graph_cache_never_serves_a_stale_scale():
    """FX graph cache on: compile, change the buffers in place, reset Dynamo, compile again (the
    same graph: a cache hit) and the results follow the new values."""
    from torch._inductor.utils import fresh_inductor_cache

    model, md, inputs = case()
    counters.clear()
    results = []
    with fresh_inductor_cache(), torch._inductor.config.patch(fx_graph_cache=True):
        with torch._functorch.config.patch(enable_autograd_cache=False):
            for out_scale, k_scale in ((OUT_SCALE, 0.02), (0.03, 0.004)):
                model.out_scale.fill_(out_scale)
                model.k_scale.fill_(k_scale)
                torch._dynamo.reset()
                compiled = torch.compile(model, backend=make_kvq_backend(), fullgraph=True)
                results.append(_check(model, md, inputs, compiled, f"out_scale {out_scale}"))
    assert counters["inductor"]["fxgraph_cache_miss"] == 1
    assert counters["inductor"]["fxgraph_cache_hit"] == 1  # served from the cache, yet correct
    assert not torch.equal(results[0][1], results[1][1])
    assert not torch.equal(results[0][0].view(torch.uint8), results[1][0].view(torch.uint8))
    registry.unregister(model.attn)
