"""Property test: compiled (kvq passes) equals eager on random models and mixed batches.

Hypothesis draws a model structure (1-4 attention layers, each with its own heads, head size,
sliding window and soft-cap; kv cache dtype; skip rules in every accepted form; default and
per-layer scales; model dtype; k/v quant form; an optional static FP8 quant of each attention
output) and a two-step workload (a prefill batch, then a batch mixing decodes, chunked prefills and
new sequences). Each step runs eagerly (the unfused reference form) and compiled with
``make_kvq_backend(inner="eager")`` (AOT + Inductor decompositions + the passes, no codegen: cheap
to compile; the token count is marked dynamic so one graph serves both steps).

Checked: every KV cache is bit-identical (every layer's k / v are computed from the model input,
so quantization sees the same values); each layer's attention output matches within the
rounding the fusions are allowed to change (see ``check_close``); the report fused quant+write and
dequant+attention on exactly the quantized layers, and the output quant on exactly the quantized
layers when the model has one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from torch import nn

from torch_kvq.attention import Attention, PageAllocator, ReferenceKernel, forward_context
from torch_kvq.attention.kernels.base import AttentionKernel
from torch_kvq.attention.quant import FP8_MAX
from torch_kvq.passes import make_kvq_backend
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig
from torch_kvq.spec_resolve import resolve_layer_specs

HIDDEN = 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_uid = itertools.count()


@dataclass(frozen=True)
class LayerShape:
    num_heads: int
    num_kv_heads: int
    head_size: int
    window: int | None
    soft_cap: float | None


@dataclass(frozen=True)
class Structure:
    layers: tuple[LayerShape, ...]
    kv_cache_dtype: str
    skip: tuple[tuple[str, int], ...]  # (form, layer index); form in idx|neg|name|glob|class
    scales: tuple[float, float]
    layer_scales: tuple[tuple[int, float, float], ...]
    dtype: str
    quant_form: str  # how k / v are quantized in the eager form: the kvq op or torch code
    out_quant: tuple[str, float] | None  # (form, scale) of the static FP8 o_proj-input quant
    page_size: int

    def config(self, names: list[str]) -> KVCacheConfig:
        n = len(names)
        rules: list[int | str] = []
        for form, i in self.skip:
            if form == "class":
                rules.append(("sliding_window", "full_attention")[i])
            elif form == "idx":
                rules.append(i)
            elif form == "neg":
                rules.append(i - n)
            elif form == "name":
                rules.append(names[i])
            else:  # a glob matching exactly this layer
                rules.append(names[i].replace(".layers.", ".*layers.", 1))
        return KVCacheConfig(
            self.kv_cache_dtype,
            skip_layers=tuple(rules),
            page_size=self.page_size,
            kv_scales={names[i]: (k, v) for i, k, v in self.layer_scales},
            default_k_scale=self.scales[0],
            default_v_scale=self.scales[1],
        )


SCALES = st.floats(0.004, 0.08, allow_nan=False)


@st.composite
def structures(
    draw: st.DrawFn,
    max_layers: int = 4,
    head_sizes: Sequence[int] = (8, 16),
    soft_caps: Sequence[float | None] = (None, None, 4.0),
    dtypes: Sequence[str] = ("bf16", "bf16", "fp16", "fp32"),
    page_sizes: Sequence[int] = (1, 2, 4, 8, 16),
) -> Structure:
    """A random model structure; the arguments narrow it (the FlashInfer variant: its shapes)."""
    n = draw(st.integers(1, max_layers))
    layers = []
    for _ in range(n):
        kv, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 4]))
        layers.append(
            LayerShape(
                num_heads=kv * group,
                num_kv_heads=kv,
                head_size=draw(st.sampled_from(head_sizes)),
                window=draw(st.one_of(st.none(), st.integers(1, 9))),
                soft_cap=draw(st.sampled_from(soft_caps)),
            )
        )
    skipped = draw(st.sets(st.integers(0, n - 1), max_size=n - 1))  # keep one layer FP8 mostly
    skip = [(draw(st.sampled_from(["idx", "neg", "name", "glob"])), i) for i in sorted(skipped)]
    if draw(st.integers(0, 3)) == 0:  # a class rule: sliding_window (even) / full_attention (odd)
        skip.append(("class", draw(st.integers(0, 1))))
    scaled = draw(st.sets(st.integers(0, n - 1), max_size=n))
    return Structure(
        layers=tuple(layers),
        kv_cache_dtype=draw(st.sampled_from(["fp8"] * 5 + ["auto"])),
        skip=tuple(draw(st.permutations(skip))),
        scales=(draw(SCALES), draw(SCALES)),
        layer_scales=tuple((i, draw(SCALES), draw(SCALES)) for i in sorted(scaled)),
        dtype=draw(st.sampled_from(dtypes)),
        quant_form=draw(st.sampled_from(["op", "torch"])),
        out_quant=draw(st.one_of(st.none(), st.tuples(st.sampled_from(["op", "torch"]), SCALES))),
        page_size=draw(st.sampled_from(page_sizes)),
    )


@st.composite
def workloads(draw: st.DrawFn) -> list[list[tuple[int, int]]]:
    """Two steps of (sequence id, new tokens); each step has >= 2 tokens (dynamic T)."""
    lens = st.integers(1, 10)
    first = [(i, draw(lens)) for i in range(draw(st.integers(1, 3)))]
    if sum(n for _, n in first) < 2:
        first[0] = (0, 2)
    second = []
    for sid, _ in first:
        kind = draw(st.sampled_from(["decode", "decode", "chunk", "idle"]))
        if kind != "idle":
            second.append((sid, 1 if kind == "decode" else draw(st.integers(2, 5))))
    second += [(10 + i, draw(lens)) for i in range(draw(st.integers(0, 2)))]
    while sum(n for _, n in second) < 2:
        second.append((20 + len(second), 1))
    return [first, draw(st.permutations(second))]


def static_fp8_quant(x: torch.Tensor, form: str, scale: float) -> torch.Tensor:
    if form == "op":
        return torch.ops.kvq.quantize_fp8(x, scale)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


class FuzzModel(nn.Module):
    """Independent attention layers on one input: layer i's q / k / v are ``x @ W``; its output
    (optionally FP8-quantized and back, the o_proj input quant) goes through ``o_proj`` and all
    layers are summed. forward(x [T, HIDDEN]) -> (y [T, HIDDEN], [per-layer outputs])."""

    def __init__(self, s: Structure, num_pages: int, seed: int) -> None:
        super().__init__()
        tag = f"fz{next(_uid)}"
        infos = [
            AttentionLayerInfo(
                f"{tag}.layers.{i}.attn", ls.num_heads, ls.num_kv_heads, ls.head_size,
                sliding_window=ls.window, logits_soft_cap=ls.soft_cap,
            )
            for i, ls in enumerate(s.layers)
        ]  # fmt: skip
        self.specs = resolve_layer_specs(s.config([i.name for i in infos]), infos, DTYPES[s.dtype])
        kv_form = "op" if s.quant_form == "op" else "torch"
        self.attn = nn.ModuleList(Attention(sp, num_pages, quant_form=kv_form) for sp in self.specs)
        self.out_quant = s.out_quant
        g = torch.Generator().manual_seed(seed)
        self.w = nn.ParameterList()
        for sp in self.specs:
            q_dim, kv_dim = sp.num_heads * sp.head_size, sp.num_kv_heads * sp.head_size
            for shape in [(HIDDEN, q_dim), (HIDDEN, kv_dim), (HIDDEN, kv_dim), (q_dim, HIDDEN)]:
                w = torch.randn(shape, generator=g) * shape[0] ** -0.5
                self.w.append(nn.Parameter(w.to(sp.model_dtype), requires_grad=False))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        t = x.shape[0]
        y = torch.zeros_like(x)
        outs = []
        for i, (attn, sp) in enumerate(zip(self.attn, self.specs)):
            # one index at a time: torch 2.11's Dynamo cannot trace slicing a ParameterList
            wq, wk, wv, wo = (self.w[4 * i + j] for j in range(4))
            q = (x @ wq).view(t, sp.num_heads, sp.head_size)
            k = (x @ wk).view(t, sp.num_kv_heads, sp.head_size)
            v = (x @ wv).view(t, sp.num_kv_heads, sp.head_size)
            o = attn(q, k, v).reshape(t, -1)
            if self.out_quant is not None:
                form, scale = self.out_quant
                o = (static_fp8_quant(o, form, scale).float() * scale).to(x.dtype)
            outs.append(o)
            y = y + o @ wo
        return y, outs


def check_close(c: torch.Tensor, e: torch.Tensor, out_scale: float | None, what: str) -> None:
    """Per element: ``|c - e| <= 2**-6 * max|e| of the token (+ one FP8 step with an output quant)``.

    The eager form dequantizes the cache into the model dtype and rounds the attention output to
    it; the fused form reads the FP8 cache in fp32 (and quantizes the fp32 output directly). That
    moves outputs by a few model-dtype rounding steps of the token's largest value; an FP8 output
    quant can then land one FP8 step (1/8 of the binade) apart.
    """
    c, e = c.float(), e.float()
    bound = 2**-6 * e.abs().amax(-1, keepdim=True) + 1e-6
    if out_scale is not None:
        m = torch.maximum(c.abs(), e.abs()) / out_scale
        step = torch.where(
            m >= 2**-6, torch.exp2(torch.floor(torch.log2(m.clamp_min(2**-6))) - 3), 2**-9
        )
        bound = bound + step * out_scale
    worst = ((c - e).abs() / bound).max().item()
    assert worst <= 1.0, f"{what}: compiled vs eager off by {worst:.2f}x the allowed difference"


def run_case(
    s: Structure,
    steps: list[list[tuple[int, int]]],
    seed: int,
    kernel: Callable[[], AttentionKernel] = ReferenceKernel,
    device: str = "cpu",
) -> None:
    """Run ``steps`` eagerly and compiled on ``kernel()`` (a fresh one per run) on ``device``."""
    total: dict[int, int] = {}
    for step in steps:
        for sid, n in step:
            total[sid] = total.get(sid, 0) + n
    num_pages = sum(-(-n // s.page_size) for n in total.values()) + 1
    model = FuzzModel(s, num_pages, seed).to(device)
    g = torch.Generator().manual_seed(seed + 1)
    alloc = PageAllocator(num_pages, s.page_size)
    mds = [alloc.build_batch(step, device=device) for step in steps]
    xs = [torch.randn(md.num_tokens, HIDDEN, generator=g).to(device, DTYPES[s.dtype]) for md in mds]

    def run(fn) -> tuple[list, list[torch.Tensor]]:
        for attn in model.attn:
            attn.kv_cache.zero_()
        results = []
        k = kernel()
        for md, x in zip(mds, xs):
            with forward_context(md, model.specs, k):
                results.append(fn(x))
        return results, [a.kv_cache.view(torch.uint8).clone() for a in model.attn]

    torch._dynamo.reset()
    backend = make_kvq_backend(inner="eager")
    compiled_fn = torch.compile(model, backend=backend, fullgraph=True)
    for x in xs:
        torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        eager, eager_caches = run(model)
        compiled, compiled_caches = run(compiled_fn)
    torch._dynamo.reset()

    assert backend.managers, "the kvq backend never compiled a graph"
    quantized = {sp.name for sp in model.specs if sp.is_quantized}
    event(f"{len(model.specs)} layers, {len(quantized)} quantized")
    event("second step: " + ("decode only" if mds[1].is_decode_only else "mixed"))
    event(f"{s.dtype}, output quant {'on' if s.out_quant else 'off'}")
    # only kernels that write FP8 output take the output quant (FlashInfer's fa2: never)
    writes_fp8 = isinstance(kernel(), ReferenceKernel)
    want_out = quantized if s.out_quant is not None and writes_fp8 else set()
    for manager in backend.managers:
        rep = manager.last
        assert rep is not None and set(rep.layers) == {sp.name for sp in model.specs}
        assert set(rep.layers_fused("quant+write")) == quantized, rep.format()
        assert set(rep.layers_fused("dequant+attn")) == quantized, rep.format()
        assert set(rep.layers_fused("output quant")) == want_out, rep.format()
    for i, (c, e) in enumerate(zip(compiled_caches, eager_caches)):
        assert torch.equal(c, e), f"layer {i}: KV cache bytes differ ({model.specs[i].mode.value})"
    out_scale = s.out_quant[1] if s.out_quant is not None else None
    for step, ((y_c, outs_c), (y_e, outs_e)) in enumerate(zip(compiled, eager)):
        for i, (c, e) in enumerate(zip(outs_c, outs_e)):
            check_close(c, e, out_scale, f"step {step} layer {i} ({model.specs[i].mode.value})")
        # the rest of the compiled graph: y from its own per-layer outputs, as eager computes it
        y_from_outs = torch.zeros_like(y_e)
        for i, o in enumerate(outs_c):
            y_from_outs = y_from_outs + o @ model.w[4 * i + 3]
        torch.testing.assert_close(y_c, y_from_outs, atol=1e-2, rtol=1e-2)


COMMON = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


L = LayerShape
MIXED = Structure(  # Gemma-like: sliding layers skipped by the class rule, per-layer scales
    layers=(L(4, 2, 16, 4, None), L(4, 2, 16, 4, None), L(4, 2, 16, None, 4.0)),
    kv_cache_dtype="fp8",
    skip=(("class", 0),),
    scales=(0.02, 0.03),
    layer_scales=((2, 0.015, 0.05),),
    dtype="bf16",
    quant_form="op",
    out_quant=("op", 0.02),
    page_size=4,
)
ALL_FP8 = Structure(  # every layer FP8, torch-native quant code, pages of one token
    layers=(L(2, 2, 8, None, None), L(4, 1, 16, 2, None)),
    kv_cache_dtype="fp8",
    skip=(),
    scales=(0.01, 0.07),
    layer_scales=(),
    dtype="fp16",
    quant_form="torch",
    out_quant=("torch", 0.05),
    page_size=1,
)
SKIPS = Structure(  # skip rules by negative index and by glob; no output quant
    layers=(L(2, 1, 8, None, None), L(2, 1, 8, 3, None), L(2, 1, 8, None, None)),
    kv_cache_dtype="fp8",
    skip=(("neg", 0), ("glob", 1)),
    scales=(0.05, 0.04),
    layer_scales=(),
    dtype="bf16",
    quant_form="op",
    out_quant=None,
    page_size=2,
)


@settings(max_examples=2, derandomize=True, **COMMON)
@given(structure=structures(), steps=workloads(), seed=st.integers(0, 2**16))
@example(structure=MIXED, steps=[[(0, 9), (1, 3)], [(0, 1), (1, 2), (10, 5)]], seed=1)
@example(structure=ALL_FP8, steps=[[(0, 6)], [(0, 1), (10, 1)]], seed=2)
@example(structure=SKIPS, steps=[[(0, 4), (1, 7)], [(1, 1), (0, 1)]], seed=3)
def test_compiled_equals_eager_sample(structure: Structure, steps, seed: int) -> None:
    run_case(structure, steps, seed)


@pytest.mark.slow
@settings(max_examples=500, **COMMON)
@given(structure=structures(), steps=workloads(), seed=st.integers(0, 2**16))
def test_compiled_equals_eager_500(structure: Structure, steps, seed: int) -> None:
    run_case(structure, steps, seed)
