"""The test_fusion_attn.py scenario (vLLM tests/compile/passes): one attention layer followed by
a static FP8 quant of its output (the o_proj input), compiled with the kvq passes.

Tolerance of compiled vs eager outputs (FP8 values, before scaling back): the unfused eager form
dequantizes the cache to the model dtype and rounds the attention output to it before quantizing;
the fused form reads the FP8 cache in fp32 and quantizes the fp32 result. The attention outputs
then differ by about one model-dtype rounding step of the largest output (measured: 0.0156 at a
max of 3.5 in bf16), and the quant adds one FP8 e4m3 step (1/8 of the value's binade, 2**-9 below
2**-6). Bound per element: ``|compiled - eager| <= fp8_step + 2**-7 * max|eager|``.
The KV cache written must be bit-identical.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.support.passes import (
    AttnQuantModel,
    batch_plan,
    caches,
    check_close,
    fill_caches,
    make_batch,
    make_specs,
    no_compile_caches,
    nodes_of,
    pages_for,
    qkv,
    restore,
)
from torch_kvq.attention import ReferenceKernel, forward_context
from torch_kvq.attention.kernels.capabilities import device_arch
from torch_kvq.passes import make_kvq_backend, make_stamp
from torch_kvq.passes.graph_utils import ATTENTION_FP8, op_args

HEAD_SIZE = 128

GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and FlashInfer"),
]
KERNELS = ["reference", "flashinfer"]


def with_marks(cases):
    """pytest params; the ones on the flashinfer kernel are marked gpu (and skip without CUDA)."""
    return [pytest.param(*c, marks=GPU_MARKS if c[0] == "flashinfer" else ()) for c in cases]


def _kernel(name: str):
    if name == "reference":
        return ReferenceKernel(), "cpu"
    from torch_kvq.attention.kernels import FlashInferKernel  # imports flashinfer lazily

    return FlashInferKernel(), "cuda"


def run_scenario(kernel_name, dtype, num_tokens, heads, kv_cache_dtype, quant_form, inner):
    kernel, device = _kernel(kernel_name)
    specs = make_specs(1, kv_cache_dtype, heads=heads, head_size=HEAD_SIZE, dtype=dtype)
    plan = batch_plan(num_tokens)
    num_pages = pages_for(plan)
    model = AttnQuantModel(specs, num_pages, quant_form).to(device)
    md = make_batch(plan, num_pages)
    if device != "cpu":
        md = type(md).build(md.page_tables, md.kv_lens, md.qo_lens, md.page_size, device=device)
    q, k, v = (t.to(device) for t in qkv(num_tokens, heads, HEAD_SIZE, dtype))
    fill_caches(model)
    saved = caches(model)
    backend = make_kvq_backend(inner=inner)
    with torch.no_grad(), forward_context(md, specs, kernel), no_compile_caches():
        eager = model(q, k, v)
        eager_caches = caches(model)
        restore(model, saved)
        compiled = torch.compile(model, backend=backend, fullgraph=True)(q, k, v)

    assert backend.managers[-1].runs == 1  # the passes ran in this process (no cache hit)
    rep = backend.managers[-1].last
    stamp = make_stamp(specs[0], kernel.name, device_arch(q.device))
    in_place, fp8_out = int(stamp.kv_in_place), int(stamp.fp8_output)
    quantized = int(specs[0].is_quantized)
    quants_before = {"op": "kvq.quantize_fp8", "torch": "fp8_cast"}[quant_form]

    # op counts before / after
    assert rep.ops_before.get(quants_before, 0) == 1 + 2 * quantized  # o_proj input (+ k, v)
    assert rep.ops_before.get("kvq.dequantize_kv_cache", 0) == quantized
    assert rep.ops_before.get("kvq.paged_attention", 0) == 1
    assert rep.ops_after.get("kvq.quant_cache_write", 0) == in_place
    assert rep.ops_after.get("kvq.cache_write", 0) == 1 - in_place
    assert rep.ops_after.get("kvq.dequantize_kv_cache", 0) == quantized - in_place
    assert rep.ops_after.get("kvq.paged_attention_fp8", 0) == in_place
    assert rep.ops_after.get(quants_before, 0) == 1 + 2 * (quantized - in_place) - fp8_out
    # fused count == eligible layers; attention node count unchanged
    assert len(rep.layers_fused("quant+write")) == in_place
    assert len(rep.layers_fused("dequant+attn")) == in_place
    assert len(rep.layers_fused("output quant")) == fp8_out
    attn_before = rep.ops_before.get("kvq.paged_attention", 0)
    attn_after = rep.ops_after.get("kvq.paged_attention", 0) + rep.ops_after.get(
        "kvq.paged_attention_fp8", 0
    )
    assert attn_before == attn_after == 1
    # output_scale only on eligible layers
    assert rep.ops_after.get("output_scale", 0) == fp8_out
    if inner == "eager":
        scaled = [
            n
            for n in nodes_of(backend.graphs[-1], ATTENTION_FP8)
            if op_args(n).get("output_scale") is not None
        ]
        assert len(scaled) == fp8_out
        assert all(op_args(n)["output_scale"] == pytest.approx(0.01) for n in scaled)
    # numerics: outputs and the cache written
    check_close(compiled[0], eager[0])
    for c_cache, e_cache in zip(caches(model), eager_caches):
        assert torch.equal(c_cache.view(torch.uint8), e_cache.view(torch.uint8))


FAST = [  # every value of every axis at least once, both inner compilers' paths
    ("reference", torch.bfloat16, 7, (64, 8), "fp8", "op"),
    ("reference", torch.float16, 256, (40, 8), "fp8", "torch"),
    ("reference", torch.bfloat16, 533, (40, 8), "auto", "op"),
    ("reference", torch.float16, 7, (64, 8), "auto", "torch"),
    ("reference", torch.bfloat16, 533, (64, 8), "fp8", "torch"),
    ("reference", torch.float16, 256, (64, 8), "fp8", "op"),
]
FULL = with_marks(
    itertools.product(
        KERNELS,
        [torch.bfloat16, torch.float16],
        [7, 256, 533],
        [(64, 8), (40, 8)],
        ["auto", "fp8"],
        ["op", "torch"],
    )
)


@pytest.mark.parametrize("kernel,dtype,num_tokens,heads,kv_cache_dtype,quant_form", FAST)
def test_fusion_attn(kernel, dtype, num_tokens, heads, kv_cache_dtype, quant_form):
    run_scenario(kernel, dtype, num_tokens, heads, kv_cache_dtype, quant_form, inner="eager")


@pytest.mark.parametrize(
    "dtype,num_tokens,heads,kv_cache_dtype,quant_form",
    [(torch.bfloat16, 7, (64, 8), "fp8", "op"), (torch.float16, 256, (40, 8), "fp8", "torch")],
)
def test_fusion_attn_inductor(dtype, num_tokens, heads, kv_cache_dtype, quant_form):
    run_scenario(
        "reference", dtype, num_tokens, heads, kv_cache_dtype, quant_form, inner="inductor"
    )


@pytest.mark.slow
@pytest.mark.parametrize("kernel,dtype,num_tokens,heads,kv_cache_dtype,quant_form", FULL)
def test_fusion_attn_full_grid(kernel, dtype, num_tokens, heads, kv_cache_dtype, quant_form):
    run_scenario(kernel, dtype, num_tokens, heads, kv_cache_dtype, quant_form, inner="eager")


@pytest.mark.slow
@pytest.mark.parametrize(
    "kernel,kv_cache_dtype,quant_form",
    with_marks(itertools.product(KERNELS, ["auto", "fp8"], ["op", "torch"])),
)
def test_fusion_attn_inductor_grid(kernel, kv_cache_dtype, quant_form):
    run_scenario(kernel, torch.bfloat16, 533, (40, 8), kv_cache_dtype, quant_form, inner="inductor")
