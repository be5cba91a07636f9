"""Small models, batches and graph helpers shared by the pass tests (tests/passes) and others."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence

import torch
from torch import fx, nn

from torch_kvq.attention import Attention, PageAllocator, ReferenceKernel, forward_context
from torch_kvq.attention.quant import FP8_MAX, quantize_fp8
from torch_kvq.passes import KVQPassManager, make_kvq_backend
from torch_kvq.passes.graph_utils import functional_op, op_args
from torch_kvq.passes.stamp import get_stamp
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig, LayerKVSpec
from torch_kvq.spec_resolve import resolve_layer_specs

PAGE_SIZE = 16
# Inductor's deterministic mode (no timed choice among a reduction's candidate configs, which on
# a busy GPU can give two compiles of one model different sum orders), for a test that compares
# two compiled copies bit for bit: ``make_kvq_backend(config_patches=DETERMINISTIC)``, so that it
# holds inside each of the backend's compiles. A process-wide ``torch._inductor.config.patch``
# does not: Dynamo resets the flag after its first trace (docs/contributing.md, Determinism).
DETERMINISTIC = {"deterministic": True}
OUT_SCALE = 0.01  # static scale of the o_proj input quant; attention outputs are O(1)
_ids = itertools.count()


@contextlib.contextmanager
def no_compile_caches():
    """Inductor's FX graph cache and the AOTAutograd cache off, so the passes always run."""
    with torch._inductor.config.patch(fx_graph_cache=False):
        with torch._functorch.config.patch(enable_autograd_cache=False):
            yield


def output_quant(x: torch.Tensor, form: str, scale: float = OUT_SCALE) -> torch.Tensor:
    """The static FP8 quant of the o_proj input, as the kvq op or as torch-native code."""
    if form == "op":
        return torch.ops.kvq.quantize_fp8(x, scale)
    if form == "mul":
        return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def make_specs(
    n: int = 1,
    kv_cache_dtype: str = "fp8",
    skip: tuple = (),
    heads: tuple[int, int] = (8, 2),
    head_size: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    window: int | None = None,
    scales: tuple[float, float] = (0.02, 0.03),
) -> tuple[LayerKVSpec, ...]:
    """``n`` layers with unique names; odd layers get a sliding ``window`` when one is given."""
    tag = next(_ids)
    infos = [
        AttentionLayerInfo(
            f"c{tag}.layers.{i}.attn",
            heads[0],
            heads[1],
            head_size,
            sliding_window=window if (window and i % 2 == 1) else None,
        )
        for i in range(n)
    ]
    cfg = KVCacheConfig(
        kv_cache_dtype=kv_cache_dtype,
        skip_layers=skip,
        page_size=PAGE_SIZE,
        default_k_scale=scales[0],
        default_v_scale=scales[1],
    )
    return resolve_layer_specs(cfg, infos, dtype)


class AttnQuantModel(nn.Module):
    """vLLM's test_fusion_attn model: attention layers, each output reshaped to [T, QH * D] and
    statically quantized to FP8 (the o_proj input). All layers share the q / k / v inputs."""

    def __init__(
        self, specs: Sequence[LayerKVSpec], num_pages: int, quant_form: str = "op"
    ) -> None:
        super().__init__()
        self.quant_form = quant_form
        kv_form = "op" if quant_form == "op" else "torch"
        self.layers = nn.ModuleList(Attention(s, num_pages, quant_form=kv_form) for s in specs)

    @property
    def specs(self) -> list[LayerKVSpec]:
        return [a.spec for a in self.layers]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for attn in self.layers:
            o = attn(q, k, v)
            outs.append(output_quant(o.reshape(o.shape[0], -1), self.quant_form))
        return outs


def batch_plan(num_tokens: int) -> list[tuple[int, int]]:
    """(past tokens, new tokens) per sequence: some decodes (1 new token, some context) and
    prefills (one with a chunked-prefill past) adding up to ``num_tokens``."""
    n_dec = min(16, num_tokens // 2)
    rest = num_tokens - n_dec
    n_pre = max(1, min(3, rest // 64))
    sizes = [rest // n_pre + (1 if i < rest % n_pre else 0) for i in range(n_pre)]
    plan = [(10 if i == 0 else 0, s) for i, s in enumerate(sizes)]
    plan += [(5 + (7 * i) % 50, 1) for i in range(n_dec)]
    assert sum(n for _, n in plan) == num_tokens
    return plan


def pages_for(plan: list[tuple[int, int]]) -> int:
    return sum(-(-(p + n) // PAGE_SIZE) for p, n in plan) + 4


def make_batch(plan: list[tuple[int, int]], num_pages: int):
    """The metadata of one step over ``plan`` (pasts reserved first, as earlier steps would)."""
    alloc = PageAllocator(num_pages, PAGE_SIZE)
    pasts = [(i, p) for i, (p, _) in enumerate(plan) if p]
    if pasts:
        alloc.append_many(pasts)
    return alloc.build_batch([(i, n) for i, (_, n) in enumerate(plan)])


def fill_caches(model: nn.Module, seed: int = 0) -> None:
    """Random KV history in every cache (FP8 caches get quantized values)."""
    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, Attention):
            x = torch.randn(mod.kv_cache.shape, generator=g)
            if mod.spec.is_quantized:
                mod.kv_cache.copy_(quantize_fp8(x, mod.spec.k_scale))
            else:
                mod.kv_cache.copy_(x.to(mod.kv_cache.dtype))


def caches(model: nn.Module) -> list[torch.Tensor]:
    return [m.kv_cache.clone() for m in model.modules() if isinstance(m, Attention)]


def restore(model: nn.Module, saved: list[torch.Tensor]) -> None:
    for m, c in zip((m for m in model.modules() if isinstance(m, Attention)), saved):
        m.kv_cache.copy_(c)


def qkv(num_tokens: int, heads: tuple[int, int], head_size: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, heads[0], head_size, generator=g).to(dtype)
    k = torch.randn(num_tokens, heads[1], head_size, generator=g).to(dtype)
    v = torch.randn(num_tokens, heads[1], head_size, generator=g).to(dtype)
    return q, k, v


def capture_graph(
    model: nn.Module, inputs: Sequence[torch.Tensor], md, kernel=None
) -> fx.GraphModule:
    """The post-grad-shaped graph of ``model`` before any kvq pass (AOT + Inductor decomps)."""
    torch._dynamo.reset()
    backend = make_kvq_backend(inner="eager", passes=())
    kernel = kernel or ReferenceKernel()
    with torch.no_grad(), forward_context(md, [a.spec for a in attn_layers(model)], kernel):
        torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    return backend.graphs[-1]


def attn_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def check_compiled_equals_eager(specs, model: nn.Module, md, inputs) -> None:
    """``model`` run eagerly, then (caches zeroed) compiled with the kvq passes, both on the
    reference kernel: layer 0 fused both ways (quant+write, dequant+attn), and the outputs and
    every layer's cache and scales equal bit for bit (as bytes; the scales written, not zero)."""
    layers = attn_layers(model)
    with torch.no_grad(), forward_context(md, specs, ReferenceKernel()):
        eager = model(*inputs)
    want = [
        (a.kv_cache.clone(), None if a.kv_scale is None else a.kv_scale.clone()) for a in layers
    ]
    for a in layers:
        a.kv_cache.zero_()
        if a.kv_scale is not None:
            a.kv_scale.zero_()
    backend = make_kvq_backend(inner="eager")
    torch._dynamo.reset()
    with torch.no_grad(), no_compile_caches(), forward_context(md, specs, ReferenceKernel()):
        compiled = torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    assert backend.managers[-1].last.fused(specs[0].name) == ("quant+write", "dequant+attn")
    for c, e in zip(compiled, eager):
        assert torch.equal(c.view(torch.uint8), e.view(torch.uint8))
    for a, (cache, scale) in zip(layers, want):
        assert torch.equal(a.kv_cache.view(torch.uint8), cache.view(torch.uint8))
        assert scale is None or (torch.equal(a.kv_scale, scale) and scale.any())


def run_passes(
    gm: fx.GraphModule, specs: Sequence[LayerKVSpec], passes: Sequence[str], **kw
) -> KVQPassManager:
    manager = KVQPassManager(specs, passes=passes, **kw)
    manager(gm.graph)
    gm.recompile()
    return manager


def nodes_of(gm: fx.GraphModule, op) -> list[fx.Node]:
    """Nodes running ``op`` (also through auto_functionalized)."""
    return [n for n in gm.graph.nodes if functional_op(n) is op]


def layer_of(node: fx.Node) -> str:
    stamp = get_stamp(node)
    return stamp.layer if stamp is not None else op_args(node)["layer_name"]


def small_case(
    quant_form: str = "op",
    skip: tuple = (1,),
    n: int = 3,
    kv_cache_dtype: str = "fp8",
    num_tokens: int = 7,
):
    """A small ``AttnQuantModel`` (layer 1 skipped by default), its batch and inputs."""
    specs = make_specs(n, kv_cache_dtype, skip=skip)
    plan = batch_plan(num_tokens)
    num_pages = pages_for(plan)
    model = AttnQuantModel(specs, num_pages, quant_form)
    md = make_batch(plan, num_pages)
    return model, md, qkv(num_tokens, (8, 2), 32, torch.bfloat16)


class ManualLayer(nn.Module):
    """One FP8 layer written out by hand, to vary what the passes see: ``kv_quant(x, scale)``
    quantizes k / v, ``dequant_dtype`` is what the cache is dequantized to (float32, the layer's
    own form, unless given), ``attend_dtype`` what it is cast to before the attention (no cast
    unless given), ``out_form`` quantizes the output (None: no quant) and
    ``also_return_output`` gives the attention output a second user."""

    def __init__(
        self,
        spec: LayerKVSpec,
        num_pages: int,
        kv_quant,
        dequant_dtype=torch.float32,
        attend_dtype=None,
        out_form="op",
        also_return_output=False,
    ):
        super().__init__()
        self.attn = Attention(spec, num_pages)
        self.kv_quant = kv_quant
        self.dequant_dtype = dequant_dtype
        self.attend_dtype = attend_dtype
        self.out_form = out_form
        self.also_return_output = also_return_output

    @property
    def specs(self) -> list[LayerKVSpec]:
        return [self.attn.spec]

    def forward(self, q, k, v):
        s = self.attn.spec
        torch.ops.kvq.cache_write(
            self.kv_quant(k, s.k_scale), self.kv_quant(v, s.v_scale), self.attn.kv_cache, s.name
        )
        kv = torch.ops.kvq.dequantize_kv_cache(
            self.attn.kv_cache, s.k_scale, s.v_scale, self.dequant_dtype, s.name
        )
        o = torch.ops.kvq.paged_attention(q, kv.to(self.attend_dtype or kv.dtype), s.name)
        out = o if self.out_form is None else output_quant(o.reshape(o.shape[0], -1), self.out_form)
        return (out, o) if self.also_return_output else out


def torch_quant(x, scale):
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def mul_quant(x, scale):
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def model_dtype_quant(x, scale):
    """Not fusable bit for bit: ``x / scale`` in bf16 rounds to bf16 before the FP8 cast."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def clamp240_quant(x, scale):
    """Not the static FP8 quant the passes match (clamps to +-240)."""
    return (x.float() / scale).clamp(-240.0, 240.0).to(torch.float8_e4m3fn)


def manual_case(**kw):
    (spec,) = make_specs(1, "fp8")
    plan = batch_plan(7)
    num_pages = pages_for(plan)
    kw.setdefault("kv_quant", lambda x, s: torch.ops.kvq.quantize_fp8(x, s))
    model = ManualLayer(spec, num_pages, **kw)
    return model, make_batch(plan, num_pages), qkv(7, (8, 2), 32, torch.bfloat16)


def check_close(compiled: torch.Tensor, eager: torch.Tensor) -> None:
    assert compiled.dtype == eager.dtype == torch.float8_e4m3fn
    c, e = compiled.float(), eager.float()
    m = torch.maximum(c.abs(), e.abs())
    step = torch.where(
        m >= 2**-6, torch.exp2(torch.floor(torch.log2(m.clamp_min(2**-6))) - 3), 2**-9
    )
    bound = step + 2**-7 * e.abs().max()
    worst = ((c - e).abs() / bound).max().item()
    assert worst <= 1.0, f"compiled vs eager FP8 outputs: {worst:.2f}x the allowed difference"


class RecordingKernel:
    """Wraps a kernel; records per layer the (q dtype, cache dtype) each step planned for, and
    the (q dtype, cache dtype, FP8 output asked, per-(token, head) scales given) it attended
    with."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name
        self.supports_cuda_graphs = inner.supports_cuda_graphs
        self.planned: dict[str, set[tuple[torch.dtype, torch.dtype]]] = {}
        self.attended: dict[str, set[tuple[torch.dtype, torch.dtype, bool, bool]]] = {}

    def check_supported(self, spec) -> None:
        self.inner.check_supported(spec)

    def plan(self, ctx, specs) -> None:
        for s in specs:
            self.planned.setdefault(s.name, set()).add((s.model_dtype, s.storage_dtype))
        self.inner.plan(ctx, specs)

    def attend(self, ctx, spec, q, kv_cache, k_scale, v_scale, output_scale, kv_scale=None):
        key = (q.dtype, kv_cache.dtype, output_scale is not None, kv_scale is not None)
        self.attended.setdefault(spec.name, set()).add(key)
        return self.inner.attend(ctx, spec, q, kv_cache, k_scale, v_scale, output_scale, kv_scale)


def check_layer0_fuses_and_equals_eager(specs) -> None:
    """``specs`` (layer 0 quantized) in ``AttnQuantModel`` on a batch of a prefill, a decode and a
    short prefill: the passes fuse layer 0 both ways, and ``check_compiled_equals_eager``."""
    plan = [(0, 5), (3, 1), (0, 2)]
    n = pages_for(plan)
    model = AttnQuantModel(specs, n)
    md, inputs = make_batch(plan, n), qkv(8, (8, 2), 32, torch.bfloat16)
    passes = ("annotate", "fuse_quant_cache_write", "fuse_dequant_attention", "cleanup")
    rep = run_passes(capture_graph(model, inputs, md), specs, passes).last
    assert rep.fused(specs[0].name) == ("quant+write", "dequant+attn")
    check_compiled_equals_eager(specs, model, md, inputs)
