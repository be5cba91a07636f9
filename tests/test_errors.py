"""Every row of docs/errors.md is tried here: the doc is the expectation, this file the inputs.

docs/errors.md holds tables of ``| `id` | input | `Exception` | `message excerpt` |``. Each id
maps to one thunk below (``@case(id)``) that feeds the bad input. The test runs the thunk and
checks the exact exception type and that the message contains the excerpt (``...`` in an excerpt
skips a variable part, such as a generated layer name). A doc row without a thunk, or a thunk
without a doc row, fails ``test_doc_and_cases_agree``, so the table and the tests cannot drift.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from unittest import mock

import pytest
import torch

from torch_kvq.attention import (
    Attention,
    PageAllocator,
    ReferenceKernel,
    calibrate_kv_scales,
    registry,
)
from torch_kvq.attention.context import forward_context
from torch_kvq.attention.kernels import FlashInferKernel, capabilities
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig
from torch_kvq.spec_modes import FP8_DTYPE
from torch_kvq.spec_resolve import resolve_layer_specs

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
ROW = re.compile(
    r"^\|\s*`(?P<id>[\w.-]+)`\s*\|(?P<input>.+?)\|\s*`(?P<exc>\w+)`\s*\|\s*`(?P<msg>[^`]+)`\s*\|\s*$"
)
ops = torch.ops.kvq

CASES: dict[str, Callable[[], object]] = {}


def case(case_id: str) -> Callable[[Callable[[], object]], Callable[[], object]]:
    def register(fn: Callable[[], object]) -> Callable[[], object]:
        assert case_id not in CASES, f"case id {case_id} defined twice"
        CASES[case_id] = fn
        return fn

    return register


@dataclass(frozen=True)
class DocRow:
    case_id: str
    input: str
    exc: str
    excerpt: str


def doc_rows() -> dict[str, DocRow]:
    rows: dict[str, DocRow] = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line.strip())
        if m:
            assert m["id"] not in rows, f"docs/errors.md lists {m['id']} twice"
            rows[m["id"]] = DocRow(m["id"], m["input"].strip(), m["exc"], m["msg"])
    return rows


# --- small fixtures the thunks build fresh each time -------------------------------------------

_uid = itertools.count()
HEADS, KV_HEADS, D, PAGE = 4, 2, 16, 4


def infos(n: int = 4, prefix: str = "m") -> list[AttentionLayerInfo]:
    """n layers named ``{prefix}.layers.{i}.attn``; even layers have a sliding window of 8."""
    return [
        AttentionLayerInfo(
            f"{prefix}.layers.{i}.attn",
            HEADS,
            KV_HEADS,
            D,
            sliding_window=8 if i % 2 == 0 else None,
        )
        for i in range(n)
    ]


def resolve(cfg: KVCacheConfig, dtype: torch.dtype = torch.bfloat16, n: int = 4):
    return resolve_layer_specs(cfg, infos(n), dtype)


@dataclass
class Env:
    """Two live layers (0 skipped -> bf16 cache, 1 fp8), a batch of ``T`` new tokens, q/k/v."""

    specs: tuple
    attns: list[Attention]
    md: object
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def ctx(self, specs: tuple | None = None):
        return forward_context(self.md, self.specs if specs is None else specs, ReferenceKernel())


def env(
    tokens: int = 3, num_pages: int = 8, alloc_pages: int | None = None, page_size: int = PAGE
) -> Env:
    cfg = KVCacheConfig(
        "fp8", skip_layers=(0,), page_size=page_size, default_k_scale=0.05, default_v_scale=0.05
    )
    specs = resolve_layer_specs(cfg, infos(2, f"e{next(_uid)}"))
    attns = [Attention(s, num_pages) for s in specs]
    md = PageAllocator(alloc_pages or num_pages, page_size).build_batch([("a", tokens)])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, HEADS, D, generator=g).bfloat16()
    k = torch.randn(tokens, KV_HEADS, D, generator=g).bfloat16()
    v = torch.randn(tokens, KV_HEADS, D, generator=g).bfloat16()
    return Env(specs, attns, md, q, k, v)


def batch(page_tables, kv_lens, qo_lens, page_size: int = PAGE):
    from torch_kvq.attention.metadata import BatchMetadata

    return BatchMetadata.build(page_tables, kv_lens, qo_lens, page_size)


# --- config: KVCacheConfig and resolve_layer_specs ---------------------------------------------


@case("config.dtype-unknown")
def _() -> object:
    return KVCacheConfig(kv_cache_dtype="fp9")


@case("config.dtype-e5m2")
def _() -> object:
    return KVCacheConfig(kv_cache_dtype="fp8_e5m2")


@case("config.dtype-not-a-string")
def _() -> object:
    return KVCacheConfig(kv_cache_dtype=torch.float8_e4m3fn)  # type: ignore[arg-type]


@case("config.dtype-disagrees-with-model")
def _() -> object:
    return resolve(KVCacheConfig("float16"), torch.bfloat16)


@case("config.model-dtype-unsupported")
def _() -> object:
    return resolve(KVCacheConfig("fp8"), torch.float64)


@case("config.not-a-config")
def _() -> object:
    return resolve_layer_specs({"kv_cache_dtype": "fp8"}, infos())  # type: ignore[arg-type]


@case("config.skip-rule-float")
def _() -> object:
    return KVCacheConfig("fp8", skip_layers=(1.5,))  # type: ignore[arg-type]


@case("config.skip-rule-bool")
def _() -> object:
    return KVCacheConfig("fp8", skip_layers=(True,))


@case("config.skip-rule-empty")
def _() -> object:
    return KVCacheConfig("fp8", skip_layers=(" ",))


@case("config.skip-rule-typo")
def _() -> object:
    return resolve(KVCacheConfig("fp8", skip_layers=("slidng_window",)))


@case("config.skip-rule-duplicate")
def _() -> object:
    return KVCacheConfig("fp8", skip_layers=("sliding_window", "sliding_window"))


@case("config.skip-index-duplicate")
def _() -> object:
    return KVCacheConfig("fp8", skip_layers=(1, 1))


@case("config.skip-index-conflict")
def _() -> object:
    return resolve(KVCacheConfig("fp8", skip_layers=(1, -3)))


@case("config.skip-index-out-of-range")
def _() -> object:
    return resolve(KVCacheConfig("fp8", skip_layers=(4,)))


@case("config.skip-index-negative-out-of-range")
def _() -> object:
    return resolve(KVCacheConfig("fp8", skip_layers=(-5,)))


@case("config.skip-glob-matches-nothing")
def _() -> object:
    return resolve(KVCacheConfig("fp8", skip_layers=("decoder.*",)))


@case("config.page-size-unsupported")
def _() -> object:
    return KVCacheConfig(page_size=3)


@case("config.page-size-too-large")
def _() -> object:
    return KVCacheConfig(page_size=256)


@case("config.page-size-bool")
def _() -> object:
    return KVCacheConfig(page_size=True)


@case("config.default-scale-zero")
def _() -> object:
    return KVCacheConfig("fp8", default_k_scale=0.0)


@case("config.default-scale-nan")
def _() -> object:
    return KVCacheConfig("fp8", default_v_scale=math.nan)


@case("config.default-scale-string")
def _() -> object:
    return KVCacheConfig("fp8", default_k_scale="0.5")  # type: ignore[arg-type]


@case("config.kv-scales-inf")
def _() -> object:
    return KVCacheConfig("fp8", kv_scales={0: (math.inf, 1.0)})


@case("config.kv-scales-negative")
def _() -> object:
    return KVCacheConfig("fp8", kv_scales={"m.layers.1.attn": (1.0, -0.5)})


@case("config.kv-scales-not-a-pair")
def _() -> object:
    return KVCacheConfig("fp8", kv_scales={0: 1.0})  # type: ignore[dict-item]


@case("config.kv-scales-key-type")
def _() -> object:
    return KVCacheConfig("fp8", kv_scales={1.5: (1.0, 1.0)})  # type: ignore[dict-item]


@case("config.kv-scales-duplicate")
def _() -> object:
    return KVCacheConfig("fp8", kv_scales=((0, (1.0, 1.0)), (0, (2.0, 2.0))))


@case("config.kv-scales-unknown-layer")
def _() -> object:
    return resolve(KVCacheConfig("fp8", kv_scales={"nope": (1.0, 1.0)}))


@case("config.kv-scales-index-out-of-range")
def _() -> object:
    return resolve(KVCacheConfig("fp8", kv_scales={9: (1.0, 1.0)}))


@case("config.kv-scales-index-and-name")
def _() -> object:
    return resolve(KVCacheConfig("fp8", kv_scales={0: (1.0, 1.0), "m.layers.0.attn": (2.0, 2.0)}))


# --- layers the model declares ------------------------------------------------------------------


@case("layers.none")
def _() -> object:
    return resolve_layer_specs(KVCacheConfig("fp8"), [])


@case("layers.not-layer-info")
def _() -> object:
    return resolve_layer_specs(KVCacheConfig("fp8"), [{"name": "a"}])  # type: ignore[list-item]


@case("layers.duplicate-names")
def _() -> object:
    return resolve_layer_specs(KVCacheConfig("fp8"), [AttentionLayerInfo("x", 4, 2, 16)] * 2)


@case("layers.empty-name")
def _() -> object:
    return resolve_layer_specs(KVCacheConfig("fp8"), [AttentionLayerInfo("", 4, 2, 16)])


@case("layers.heads-not-multiple")
def _() -> object:
    return resolve_layer_specs(KVCacheConfig("fp8"), [AttentionLayerInfo("x", 6, 4, 16)])


@case("layers.head-size-zero")
def _() -> object:
    return resolve_layer_specs(KVCacheConfig("fp8"), [AttentionLayerInfo("x", 4, 2, 0)])


@case("layers.window-zero")
def _() -> object:
    return resolve_layer_specs(
        KVCacheConfig("fp8"), [AttentionLayerInfo("x", 4, 2, 16, sliding_window=0)]
    )


@case("layers.window-float")
def _() -> object:
    return resolve_layer_specs(
        KVCacheConfig("fp8"), [AttentionLayerInfo("x", 4, 2, 16, sliding_window=2.5)]
    )  # type: ignore[arg-type]


@case("layers.soft-cap-negative")
def _() -> object:
    return resolve_layer_specs(
        KVCacheConfig("fp8"), [AttentionLayerInfo("x", 4, 2, 16, logits_soft_cap=-30.0)]
    )


@case("layers.sm-scale-zero")
def _() -> object:
    return resolve_layer_specs(
        KVCacheConfig("fp8"), [AttentionLayerInfo("x", 4, 2, 16, sm_scale=0.0)]
    )


def direct_spec(**kw) -> object:
    """A ``LayerKVSpec`` built directly (not by ``resolve_layer_specs``)."""
    from torch_kvq.spec import LayerKVSpec
    from torch_kvq.spec_modes import KVQuantMode

    args = dict(name="x", index=0, mode=KVQuantMode.NONE, storage_dtype=torch.bfloat16)
    args.update(model_dtype=torch.bfloat16, num_heads=4, num_kv_heads=2, head_size=16)
    return LayerKVSpec(**{**args, "page_size": 16, **kw})


@case("spec.sm-scale-zero")
def _() -> object:
    return direct_spec(sm_scale=0.0)


@case("spec.default-sm-scale-bad-head-size")
def _() -> object:
    return direct_spec(head_size=0)


# --- Attention layers and the layer registry ----------------------------------------------------


@case("layer.num-pages-zero")
def _() -> object:
    return Attention(resolve(KVCacheConfig("fp8"))[0], 0)


@case("layer.quant-form-unknown")
def _() -> object:
    return Attention(resolve(KVCacheConfig("fp8"))[0], 4, quant_form="fx")  # type: ignore[arg-type]


@case("layer.name-taken")
def _() -> object:
    e = env()
    return Attention(e.specs[1], 4)


@case("layer.registry-unknown")
def _() -> object:
    return registry.lookup("no.such.layer")


# --- page allocator and batch metadata ----------------------------------------------------------


@case("alloc.num-pages-zero")
def _() -> object:
    return PageAllocator(0, 4)


@case("alloc.page-size-zero")
def _() -> object:
    return PageAllocator(4, 0)


@case("alloc.token-count-zero")
def _() -> object:
    return PageAllocator(4, 4).append("a", 0)


@case("alloc.sequence-twice-in-batch")
def _() -> object:
    return PageAllocator(4, 4).build_batch([("a", 1), ("a", 1)])


@case("alloc.out-of-pages")
def _() -> object:
    alloc = PageAllocator(2, 4)
    alloc.append("a", 4)
    return alloc.build_batch([("a", 1), ("b", 5)])


@case("alloc.unknown-sequence")
def _() -> object:
    return PageAllocator(2, 4).free("zz")


@case("metadata.count-mismatch")
def _() -> object:
    return batch([[0], [1]], [2], [2, 2])


@case("metadata.empty-batch")
def _() -> object:
    return batch([], [], [])


@case("metadata.query-longer-than-kv")
def _() -> object:
    return batch([[0]], [2], [3])


@case("metadata.query-empty")
def _() -> object:
    return batch([[0]], [2], [0])


@case("metadata.page-table-too-short")
def _() -> object:
    return batch([[0]], [5], [5])


@case("metadata.page-shared")
def _() -> object:
    return batch([[0], [3, 0]], [2, 6], [2, 1])


@case("metadata.page-negative")
def _() -> object:
    return batch([[-1]], [2], [2])


@case("metadata.slot-overflow")
def _() -> object:
    return batch([[2**27]], [1], [1], page_size=16)


@case("metadata.page-size-zero")
def _() -> object:
    return batch([[0]], [2], [2], page_size=0)


# --- runtime: the forward context --------------------------------------------------------------


@case("runtime.no-forward-context")
def _() -> object:
    e = env()
    return e.attns[0](e.q, e.k, e.v)


@case("runtime.layer-not-in-context")
def _() -> object:
    e = env()
    with e.ctx(e.specs[:1]):
        return e.attns[1](e.q, e.k, e.v)


@case("runtime.page-size-mismatch")
def _() -> object:
    e = env(page_size=8)
    md = PageAllocator(8, 4).build_batch([("a", 3)])
    with forward_context(md, e.specs, ReferenceKernel()):
        return None


@case("runtime.kernel-missing-for-layer")
def _() -> object:
    e = env()
    with forward_context(e.md, e.specs, {e.specs[0].name: ReferenceKernel()}):
        return None


@case("runtime.two-specs-one-name")
def _() -> object:
    e = env()
    with e.ctx((e.specs[1], replace(e.specs[1], k_scale=0.5))):
        return None


@case("runtime.cache-smaller-than-allocator")
def _() -> object:
    e = env(tokens=9, num_pages=2, alloc_pages=8)
    with e.ctx():
        return e.attns[0](e.q, e.k, e.v)


# --- runtime: q / k / v and caches that do not match the layer's spec ----------------------------


@case("runtime.q-dtype")
def _() -> object:
    e = env()
    with e.ctx():
        return e.attns[0](e.q.half(), e.k, e.v)


@case("runtime.q-heads")
def _() -> object:
    e = env()
    with e.ctx():
        return e.attns[0](e.q[:, :2], e.k, e.v)


@case("runtime.q-tokens")
def _() -> object:
    e = env()
    with e.ctx():
        return e.attns[0](e.q[:2], e.k, e.v)


@case("runtime.k-tokens")
def _() -> object:
    e = env()
    with e.ctx():
        return e.attns[0](e.q, e.k[:2], e.v)


@case("runtime.v-head-size")
def _() -> object:
    e = env()
    with e.ctx():
        return e.attns[0](e.q, e.k, e.v[..., :8])


@case("runtime.v-dtype")
def _() -> object:
    e = env()
    with e.ctx():
        return e.attns[0](e.q, e.k, e.v.float())


@case("runtime.fp8-layer-fp8-k-shape")
def _() -> object:
    e = env()
    with e.ctx():
        return e.attns[1](e.q, e.k[:, :1], e.v[:, :1])


@case("ops.cache-write-unquantized-k-into-fp8")
def _() -> object:
    e = env()
    with e.ctx():
        return ops.cache_write(e.k, e.v, e.attns[1].kv_cache, e.specs[1].name)


@case("ops.cache-shape")
def _() -> object:
    e = env()
    with e.ctx():
        return ops.paged_attention(
            e.q, torch.zeros(8, 2, PAGE, KV_HEADS, 8).bfloat16(), e.specs[0].name
        )


@case("ops.bf16-attention-on-fp8-cache")
def _() -> object:
    e = env()
    with e.ctx():
        return ops.paged_attention(e.q, e.attns[1].kv_cache, e.specs[1].name)


@case("ops.fp8-attention-on-skipped-layer")
def _() -> object:
    e = env()
    with e.ctx():
        return ops.paged_attention_fp8(
            e.q, e.attns[0].kv_cache.to(FP8_DTYPE), 1.0, 1.0, e.specs[0].name
        )


@case("ops.quant-write-on-skipped-layer")
def _() -> object:
    e = env()
    with e.ctx():
        return ops.quant_cache_write(
            e.k, e.v, e.attns[0].kv_cache.to(FP8_DTYPE), 1.0, 1.0, e.specs[0].name
        )


@case("ops.quant-write-into-bf16-cache")
def _() -> object:
    e = env()
    with e.ctx():
        return ops.quant_cache_write(e.k, e.v, e.attns[0].kv_cache, 1.0, 1.0, e.specs[1].name)


@case("ops.dequantize-non-fp8")
def _() -> object:
    return ops.dequantize_kv_cache(torch.zeros(1, 2, 4, 2, 8), 1.0, 1.0, torch.float32, "l0")


@case("ops.dequantize-scale-nan")
def _() -> object:
    return ops.dequantize_kv_cache(
        torch.zeros(1, 2, 4, 2, 8).to(FP8_DTYPE), math.nan, 1.0, torch.float32, "l0"
    )


@case("ops.quantize-scale-zero")
def _() -> object:
    return ops.quantize_fp8(torch.ones(4), 0.0)


@case("ops.quant-write-scale-negative")
def _() -> object:
    e = env()
    with e.ctx():
        return ops.quant_cache_write(e.k, e.v, e.attns[1].kv_cache, -0.05, 0.05, e.specs[1].name)


@case("ops.fp8-attention-output-scale-zero")
def _() -> object:
    e = env()
    with e.ctx():
        return ops.paged_attention_fp8(e.q, e.attns[1].kv_cache, 0.05, 0.05, e.specs[1].name, 0.0)


@case("ops.quant-write-ts-scale-bf16")
def _() -> object:
    e = env()
    k_scale, v_scale = torch.tensor(0.05, dtype=torch.bfloat16), torch.tensor(0.05)
    with e.ctx():
        return ops.quant_cache_write_ts(
            e.k, e.v, e.attns[1].kv_cache, k_scale, v_scale, e.specs[1].name
        )


@case("ops.quant-write-ts-scale-two-elements")
def _() -> object:
    e = env()
    k_scale, v_scale = torch.tensor(0.05), torch.tensor([0.05, 0.05])
    with e.ctx():
        return ops.quant_cache_write_ts(
            e.k, e.v, e.attns[1].kv_cache, k_scale, v_scale, e.specs[1].name
        )


@case("ops.fp8-attention-two-output-scales")
def _() -> object:
    e = env()
    with e.ctx():
        return ops.paged_attention_fp8(
            e.q, e.attns[1].kv_cache, 0.05, 0.05, e.specs[1].name, 0.1, torch.tensor(0.1)
        )


# --- kernels and calibration -----------------------------------------------------------------


@case("kernel.unknown-kernel")
def _() -> object:
    return capabilities.capabilities("nope", "cpu")


@case("kernel.bad-capability")
def _() -> object:
    return capabilities.register_capabilities("bad", "cpu", [("fp8", torch.bfloat16, False)])  # type: ignore[list-item]


@case("kernel.device-unsupported")
def _() -> object:
    return capabilities.device_arch("meta")


@case("kernel.unknown-arch")
def _() -> object:
    return capabilities.check_arch("h200")


@case("kernel.bad-row-limit")
def _() -> object:
    return capabilities.register_capabilities("bad", "cpu", [], head_sizes=(0,))


def fi_specs(head_size: int = 64, dtype: torch.dtype = torch.bfloat16, page_size: int = 16, **info):
    cfg = KVCacheConfig("fp8", page_size=page_size)
    layer = AttentionLayerInfo(f"fi{next(_uid)}.attn", HEADS, KV_HEADS, head_size, **info)
    return resolve_layer_specs(cfg, [layer], dtype)


@contextlib.contextmanager
def fake_gpu(available: bool = True, arch: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """Pretend torch sees a CUDA GPU of ``arch`` (or none), so the FlashInfer support checks run
    the same on any machine; no CUDA call is made before they raise."""
    with (
        mock.patch.object(torch.cuda, "is_available", return_value=available),
        mock.patch.object(torch.cuda, "get_device_capability", return_value=arch),
    ):
        yield


@case("kernel.flashinfer-no-gpu")
def _() -> object:
    with fake_gpu(available=False):
        return FlashInferKernel().check_supported(fi_specs()[0])


@case("kernel.flashinfer-old-gpu")
def _() -> object:
    with fake_gpu(arch=(7, 5)):
        return FlashInferKernel().check_supported(fi_specs()[0])


@case("kernel.flashinfer-unknown-arch")
def _() -> object:
    with fake_gpu(arch=(11, 0)):
        return FlashInferKernel().check_supported(fi_specs()[0])


@case("kernel.flashinfer-xqa-fp8-before-sm90")
def _() -> object:
    with fake_gpu(arch=(8, 6)):
        return FlashInferKernel(fp8_decode="xqa").check_supported(fi_specs()[0])


@case("kernel.flashinfer-cpu-tensors")
def _() -> object:
    specs = fi_specs()
    md = PageAllocator(4, 16).build_batch([("a", 3)])  # metadata (and caches) on the CPU
    with fake_gpu(), forward_context(md, specs, FlashInferKernel()):
        return None


@case("kernel.flashinfer-head-size")
def _() -> object:
    with fake_gpu():
        return FlashInferKernel().check_supported(fi_specs(head_size=96)[0])


@case("kernel.flashinfer-fp32-model")
def _() -> object:
    with fake_gpu():
        return FlashInferKernel().check_supported(fi_specs(dtype=torch.float32)[0])


@case("kernel.flashinfer-xqa-soft-cap")
def _() -> object:
    with fake_gpu():
        return FlashInferKernel(fp8_decode="xqa").check_supported(fi_specs(logits_soft_cap=30.0)[0])


@case("kernel.flashinfer-xqa-page-size")
def _() -> object:
    with fake_gpu():
        return FlashInferKernel(fp8_decode="xqa").check_supported(fi_specs(page_size=8)[0])


@case("kernel.flashinfer-decode-only-got-prefill")
def _() -> object:
    specs = fi_specs()
    md = PageAllocator(4, 16).build_batch([("a", 3)])
    with fake_gpu(), forward_context(md, specs, FlashInferKernel(phases="decode")):
        return None


def kv_write_args(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A [pages 2, 2, page 16, KH 8, D 16] cache and one token's k / v, slot 0."""
    cache = torch.zeros(2, 2, 16, 8, 16, dtype=dtype)
    k = v = torch.ones(1, 8, 16, dtype=torch.bfloat16)
    return cache, k, v, torch.zeros(1, dtype=torch.int64)


@case("kernel.write-no-triton")
def _() -> object:
    from torch_kvq.attention.kernels import kv_write, launch

    launch.triton_program.cache_clear()
    try:
        with mock.patch.dict(sys.modules, {"triton": None, "triton.language": None}):
            sys.modules.pop("torch_kvq.attention.triton.kv_write", None)  # imported anew: fails
            return kv_write.write_kv_triton(*kv_write_args(torch.bfloat16))
    finally:
        launch.triton_program.cache_clear()


@case("kernel.write-cache-not-dense")
def _() -> object:
    from torch_kvq.attention.kernels.kv_write import write_kv_triton

    cache, k, v, slots = kv_write_args(torch.bfloat16)
    cache = cache.transpose(-1, -2).contiguous().transpose(-1, -2)  # same shape, D outermost
    return write_kv_triton(cache, k, v, slots)


@case("kernel.write-quant-into-bf16-cache")
def _() -> object:
    from torch_kvq.attention.kernels.kv_write import write_kv_triton

    return write_kv_triton(*kv_write_args(torch.bfloat16), scales=(1.0, 1.0))


@case("kernel.write-scale-device")
def _() -> object:
    from torch_kvq.attention.kernels.kv_write import write_kv_triton

    scales = (torch.tensor(0.1, device="meta"), torch.tensor(0.1, device="meta"))
    return write_kv_triton(*kv_write_args(torch.float8_e4m3fn), scales=scales)


@case("kernel.flashinfer-bad-option")
def _() -> object:
    return FlashInferKernel(fp8_decode="fast")  # type: ignore[arg-type]


@case("kernel.flashinfer-not-installed")
def _() -> object:
    from torch_kvq.attention.kernels.flashinfer_plan import import_flashinfer

    with mock.patch.dict(sys.modules, {"flashinfer": None}):  # None: import raises ImportError
        return import_flashinfer()


@case("kernel.flashinfer-no-cpu-row")
def _() -> object:
    return capabilities.capabilities("flashinfer", "cpu")


# --- CUDA graphs: DecodeGraphRunner ------------------------------------------------------------


def graph_runner(**kw):
    """A fresh 1-layer model (page size 4, 32 pages) and a capture=False runner for it, with
    sequence "a" at 4 tokens and "b" at 16."""
    from torch_kvq.attention.graph_runner import DecodeGraphRunner

    model = build(
        "llama-tiny", KVCacheConfig("fp8", page_size=4), num_pages=32, num_hidden_layers=1
    )
    args = dict(batch_sizes=(1, 2), max_context=16, capture=False) | kw
    runner = DecodeGraphRunner(model, **args)
    model.allocator.append("a", 4)
    model.allocator.append("b", 16)
    return model, runner


def graph_step(n_ids: int, make_md: Callable[[object], object]) -> object:
    model, runner = graph_runner()
    return runner(torch.zeros(n_ids, dtype=torch.long), make_md(model))


def one_token_batch(page: int, page_size: int = 4):
    from torch_kvq.attention import BatchMetadata

    return BatchMetadata.build([[page]], [1], [1], page_size)


@case("graphs.prefill-batch")
def _() -> object:
    return graph_step(2, lambda m: m.allocator.build_batch([("a", 2)]))


@case("graphs.batch-too-large")
def _() -> object:
    from torch_kvq.attention import BatchMetadata

    return graph_step(3, lambda m: BatchMetadata.build([[20], [21], [22]], [1] * 3, [1] * 3, 4))


@case("graphs.context-too-long")
def _() -> object:
    return graph_step(1, lambda m: m.allocator.build_batch([("b", 1)]))


@case("graphs.page-size")
def _() -> object:
    return graph_step(1, lambda m: one_token_batch(20, page_size=8))


@case("graphs.page-out-of-range")
def _() -> object:
    return graph_step(1, lambda m: one_token_batch(40))


@case("graphs.scratch-page")
def _() -> object:
    model, runner = graph_runner()
    return runner(torch.zeros(1, dtype=torch.long), one_token_batch(runner.scratch_page))


@case("graphs.closed")
def _() -> object:
    model, runner = graph_runner()
    runner.close()
    return runner(torch.zeros(1, dtype=torch.long), model.allocator.build_batch([("a", 1)]))


@case("graphs.input-ids")
def _() -> object:
    return graph_step(2, lambda m: one_token_batch(20))


@case("graphs.configure-kv-after")
def _() -> object:
    model, runner = graph_runner()
    model.configure_kv(KVCacheConfig(page_size=4))
    model.allocator.append("c", 1)
    return runner(torch.zeros(1, dtype=torch.long), model.allocator.build_batch([("c", 1)]))


@case("graphs.batch-sizes")
def _() -> object:
    return graph_runner(batch_sizes=(0, 2))


@case("graphs.max-context")
def _() -> object:
    return graph_runner(max_context=0)


@case("graphs.kernel-not-capturable")
def _() -> object:
    return graph_runner(capture=True)


@case("graphs.capture-on-cpu")
def _() -> object:
    from torch_kvq.attention.graph_runner import DecodeGraphRunner

    model = build("llama-tiny", KVCacheConfig(), num_pages=8, num_hidden_layers=1)
    model.kernel = FlashInferKernel()
    return DecodeGraphRunner(model, batch_sizes=(1,), max_context=8)


@case("graphs.flashinfer-prefill")
def _() -> object:
    from torch_kvq.attention.metadata import GraphShape

    md = PageAllocator(4, 16).build_batch([("a", 3)])
    with fake_gpu(), forward_context(md, fi_specs(), FlashInferKernel(), graph=GraphShape(1, 4)):
        return None


@case("graphs.generate-other-model")
def _() -> object:
    model, runner = graph_runner()
    return gen([[1, 2]], 2, decode=runner)


# --- models and generation ------------------------------------------------------------------


@functools.cache
def tiny_llama():
    """Built once and kept for the process, so under a prefix of its own: with the default one it
    would hold the name "model" and every later model in the process would take "model_1"."""
    from torch_kvq.models import build_model

    return build_model(
        "llama-tiny", KVCacheConfig("fp8", page_size=4), num_pages=8, num_hidden_layers=1,
        prefix="errors_tiny",
    )  # fmt: skip


def build(*args, **kwargs) -> object:
    from torch_kvq.models import build_model

    return build_model(*args, **kwargs)


def gen(*args, **kwargs) -> object:
    from torch_kvq.models import generate

    return generate(tiny_llama(), *args, **kwargs)


@case("model.unknown-preset")
def _() -> object:
    return build("gpt2-tiny", KVCacheConfig())


@case("model.dtype")
def _() -> object:
    return build("llama-tiny", KVCacheConfig(), dtype=torch.float64, num_hidden_layers=1)


@case("model.prefix")
def _() -> object:
    return build("llama-tiny", KVCacheConfig(), prefix="m.", num_hidden_layers=1)


@case("model.config-heads")
def _() -> object:
    return build("llama-tiny", KVCacheConfig(), num_attention_heads=3)


@case("model.skip-index-out-of-range")
def _() -> object:
    return build("llama-tiny", KVCacheConfig("fp8", skip_layers=(5,)), num_hidden_layers=2)


@case("model.forward-shapes")
def _() -> object:
    return tiny_llama()(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]))


@case("model.load-after-fuse")
def _() -> object:
    model = tiny_llama()
    model.fuse_projections()
    return model.load_hf_state_dict({})


@case("generate.empty-prompt")
def _() -> object:
    return gen([[1, 2], []], 2)


@case("generate.token-out-of-range")
def _() -> object:
    return gen([[1, 99999]], 2)


@case("generate.max-new-tokens-zero")
def _() -> object:
    return gen([[1, 2]], 0)


@case("generate.prompt-beyond-capacity")
def _() -> object:
    return gen([[1] * 40], 2)


@case("generate.prompts-float-tensor")
def _() -> object:
    return gen(torch.ones(2, 3), 2)


@case("generate.prompt-is-a-tensor")
def _() -> object:
    return gen([torch.tensor([1, 2]), torch.tensor([3])], 2)


@case("accuracy.empty-prompt")
def _() -> object:
    from torch_kvq.debug.accuracy import layer_accuracy

    return layer_accuracy(tiny_llama(), [[1, 2], []], KVCacheConfig("fp8", page_size=4))


# --- graph level: the compile backend, the pass manager and the annotate pass ------------------


@functools.cache
def captured():
    """A 3-layer model (layer 1 skipped) and its post-grad-shaped graph before any kvq pass."""
    from tests.support.passes import capture_graph, small_case

    model, md, inputs = small_case("op")
    return model, md, inputs, capture_graph(model, inputs, md)


def annotate(specs) -> object:
    from torch_kvq.passes import KVQPassManager

    model, md, inputs, gm = captured()
    return KVQPassManager(specs, passes=["annotate"])(copy.deepcopy(gm).graph)


@case("graph.annotate-unknown-layer")
def _() -> object:
    model = captured()[0]
    registry.unregister(model.layers[2])
    try:
        return annotate(model.specs)
    finally:
        registry.register(model.layers[2])


@case("graph.layer-not-in-manager")
def _() -> object:
    return annotate(captured()[0].specs[:2])


@case("graph.stale-spec")
def _() -> object:
    specs = list(captured()[0].specs)
    specs[0] = replace(specs[0], k_scale=0.5)
    return annotate(specs)


@case("graph.compile-unknown-layer")
def _() -> object:
    from torch_kvq.passes import make_kvq_backend

    model, md, inputs, _ = captured()
    registry.unregister(model.layers[0])
    torch._dynamo.reset()
    try:
        with torch.no_grad(), forward_context(md, model.specs, ReferenceKernel()):
            return torch.compile(model, backend=make_kvq_backend(inner="eager"))(*inputs)
    finally:
        registry.register(model.layers[0])
        torch._dynamo.reset()


class HandGraph(torch.nn.Module):
    """A hand-written graph over one Attention layer of ``spec``'s shape (named ``<spec>.hand``),
    for graphs the passes must refuse; ``run`` compiles it with the kvq passes and calls it."""

    def __init__(self, spec) -> None:
        super().__init__()
        self.attn = Attention(replace(spec, name=spec.name + ".hand"), 8)

    def run(self, md, *inputs: torch.Tensor) -> object:
        from torch_kvq.passes import make_kvq_backend

        torch._dynamo.reset()
        try:
            with torch.no_grad(), forward_context(md, [self.attn.spec], ReferenceKernel()):
                backend = make_kvq_backend(inner="eager")
                return torch.compile(self, backend=backend, fullgraph=True)(*inputs)
        finally:
            torch._dynamo.reset()


class QuantIntoSkippedCache(HandGraph):
    """Hand-written graph: k / v quantized to FP8, then written into a skipped layer's bf16 cache."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        name = self.attn.layer_name
        ops.cache_write(
            ops.quantize_fp8(k, 0.1), ops.quantize_fp8(v, 0.1), self.attn.kv_cache, name
        )
        return ops.paged_attention(q, self.attn.kv_cache, name)


@case("graph.quantize-feeds-skipped-cache")
def _() -> object:
    e = env()
    return QuantIntoSkippedCache(e.specs[0]).run(e.md, e.q, e.k, e.v)


class Fp8AttentionOnSkippedLayer(HandGraph):
    """Hand-written graph: the FP8-cache attention op on a skipped layer's (bf16) cache."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        cache = self.attn.kv_cache.to(FP8_DTYPE)
        return ops.paged_attention_fp8(q, cache, 1.0, 1.0, self.attn.layer_name)


@case("graph.fp8-attention-on-skipped-layer")
def _() -> object:
    e = env()
    return Fp8AttentionOnSkippedLayer(e.specs[0]).run(e.md, e.q)


@case("graph.backend-inner-unknown")
def _() -> object:
    from torch_kvq.passes import make_kvq_backend

    return make_kvq_backend(inner="tvm")


@case("graph.unknown-pass")
def _() -> object:
    from torch_kvq.passes import make_kvq_backend

    return make_kvq_backend(passes=["annotate", "fuse_everything"])


@case("graph.pass-not-a-pass")
def _() -> object:
    from torch_kvq.passes import AnnotatePass, make_kvq_backend

    return make_kvq_backend(passes=["annotate", AnnotatePass])


@case("graph.pass-uuid-empty")
def _() -> object:
    from torch_kvq.passes import CleanupPass, make_kvq_backend

    class NoKey(CleanupPass):
        name = "no_key"

        def uuid(self) -> None:  # type: ignore[override]
            return None

    return make_kvq_backend(passes=["annotate", NoKey()])


@case("graph.fusion-before-annotate")
def _() -> object:
    from torch_kvq.passes import KVQPassManager

    return KVQPassManager(captured()[0].specs, passes=["fuse_quant_cache_write", "annotate"])


@case("graph.manager-duplicate-specs")
def _() -> object:
    from torch_kvq.passes import KVQPassManager

    spec = captured()[0].specs[0]
    return KVQPassManager([spec, spec])


@case("graph.backend-post-grad-pass-taken")
def _() -> object:
    from torch_kvq.passes import make_kvq_backend

    return make_kvq_backend(config_patches={"post_grad_custom_post_pass": None})


@case("graph.backend-kernel-not-a-kernel")
def _() -> object:
    from torch_kvq.passes import make_kvq_backend

    return make_kvq_backend(kernel=123)  # type: ignore[arg-type]


@case("graph.backend-kernel-unknown-name")
def _() -> object:
    from torch_kvq.passes import make_kvq_backend

    return make_kvq_backend(kernel="flashinfer-fast")


@case("graph.backend-kernel-mapping-value")
def _() -> object:
    from torch_kvq.passes import make_kvq_backend

    return make_kvq_backend(kernel={"m.layers.0.attn": 1.5})  # type: ignore[dict-item]


def compile_in(specs: list | None) -> object:
    """The first call of the captured() model compiled with no kernel given, in a forward
    context entered for ``specs`` (None: outside any context)."""
    from torch_kvq.passes import make_kvq_backend

    model, md, inputs, _ = captured()
    torch._dynamo.reset()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            if specs is not None:
                stack.enter_context(forward_context(md, specs, ReferenceKernel()))
            return torch.compile(model, backend=make_kvq_backend(inner="eager"))(*inputs)
    finally:
        torch._dynamo.reset()


@case("graph.compile-no-kernel")
def _() -> object:
    return compile_in(None)


@case("graph.compile-context-lacks-layer")
def _() -> object:
    return compile_in(captured()[0].specs[:1])


@case("graph.manager-kernel-no-row-for-arch")
def _() -> object:
    from torch_kvq.passes import KVQPassManager

    return KVQPassManager(captured()[0].specs, kernel="flashinfer", arch="sm110")


# --- kvq inspect -------------------------------------------------------------------------------


def kvq(*argv: str) -> object:
    """Run a ``kvq`` subcommand's runner (what ``main`` turns into ``kvq <sub>: error: ...``)."""
    from torch_kvq.cli import build_parser
    from torch_kvq.cli.args import resolve_source

    args = build_parser().parse_args(list(argv))
    args.argv = list(argv)
    resolve_source(args)
    return args.func(args)


def inspect(*argv: str) -> object:
    return kvq("inspect", *argv)


@case("inspect.layers-not-served")
def _() -> object:
    return inspect("--arch", "sm90")


@case("modes.tc4-bases-preset")
def _() -> object:
    return inspect("--preset", "gemma3-tiny", "--kv-cache-dtype", "tc4_per_token_head",
                   "--k-bases", "FILE")  # fmt: skip


@case("inspect.head-dim-zero")
def _() -> object:
    return inspect("--head-dim", "0")


# --- kvq: the model source and the other shared options -----------------------------------------


@case("cli.hf-config-needs-weights")
def _() -> object:
    return kvq("demo", "--hf-config", "/nonexistent/config.json")


def inspect_config(text: str) -> object:
    """``kvq inspect --hf-config`` on a config.json holding ``text``."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(text)
        return inspect("--hf-config", folder)


@case("cli.hf-config-bad-json")
def _() -> object:
    return inspect_config('{"model_type": "llama",')


@case("cli.hf-config-unknown-model-type")
def _() -> object:
    return inspect_config('{"model_type": "llama9"}')


@case("cli.hf-config-encoder-decoder")
def _() -> object:
    return inspect_config('{"model_type": "t5", "num_layers": 1, "d_model": 32, "num_heads": 2}')


@case("cli.hf-config-no-causal-lm")
def _() -> object:
    return inspect_config('{"model_type": "vit", "num_hidden_layers": 1, "hidden_size": 32}')


def demo_tp(*argv: str) -> object:
    """``kvq demo ... --tp N`` with torchrun never started: a check that let it through fails."""
    from torch_kvq import distributed

    def relaunch(*_: object) -> int:
        raise AssertionError("torchrun started before --tp was checked")

    with mock.patch.object(distributed, "relaunch", relaunch):
        return kvq("demo", *argv)


@case("cli.tp-heads-not-divisible")
def _() -> object:
    return demo_tp("--preset", "llama-tiny", "--tp", "3")


@case("cli.tp-hf-model")
def _() -> object:
    return demo_tp("--hf", "qwen2", "--tp", "2")


@case("cli.tp-no-torchrun")
def _() -> object:
    with mock.patch("torch.distributed.is_available", return_value=False):
        return demo_tp("--preset", "gemma3-tiny", "--tp", "2")


@case("cli.model-unknown")
def _() -> object:
    return kvq("inspect", "--model", "gemma9")


@case("cli.model-layers")
def _() -> object:
    return kvq("demo", "--model", "gemma3-270m", "--layers", "2")


@case("cli.accuracy-calibrate-trained")
def _() -> object:
    return kvq("accuracy", "--model", "gemma3-270m", "--calibrate")


@case("calibration.no-attention-layers")
def _() -> object:
    return calibrate_kv_scales(torch.nn.Linear(2, 2), lambda: None)


@case("calibration.amax-nan")
def _() -> object:
    from torch_kvq.attention import amax_to_scale

    return amax_to_scale(math.nan)


def calibrate_with(layer: int, which: str, value: float) -> object:
    """``calibrate_kv_scales`` over one step of ``env()`` where ``layer``'s k or v is all
    ``value`` but for one element of 1.0 (all of it for value 0.0)."""
    e = env()
    bad = torch.full_like(e.k, value)
    if value != 0.0:
        bad[0, 0, 0] = 1.0

    def run() -> None:
        with e.ctx():
            for i, a in enumerate(e.attns):
                k = bad if (i, which) == (layer, "k") else e.k
                v = bad if (i, which) == (layer, "v") else e.v
                a(e.q, k, v)

    return calibrate_kv_scales(torch.nn.ModuleList(e.attns), run)


@case("calibration.k-all-zeros")
def _() -> object:
    return calibrate_with(1, "k", 0.0)


@case("calibration.v-nan")
def _() -> object:
    return calibrate_with(0, "v", math.nan)


# --- Hugging Face models: KVQCausalLM.from_hf and generate through the paged cache --------------

_HF_BASE = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
)  # fmt: skip


def _hf(
    arch: str = "Llama", dtype: torch.dtype = torch.float32, **extra: object
) -> torch.nn.Module:
    """A tiny random-weight transformers ``{arch}ForCausalLM`` (2 layers), eval mode."""
    import transformers

    config_cls = getattr(transformers, f"{arch}TextConfig", None) or getattr(
        transformers, f"{arch}Config"
    )
    model_cls = getattr(transformers, f"{arch}ForCausalLM")
    kwargs = {k: v for k, v in {**_HF_BASE, **extra}.items() if v is not None}  # None: drop
    return model_cls._from_config(config_cls(**kwargs)).to(dtype).eval()


def _attach(model: torch.nn.Module, **kw: object):
    from torch_kvq.integrations.transformers import KVQCausalLM

    return KVQCausalLM.from_hf(model, KVCacheConfig(page_size=4), num_pages=16, **kw)


@contextlib.contextmanager
def _detached(lm) -> Iterator[None]:
    """Detach ``lm`` afterwards: its layer names are free again at once, even while the raised
    error's traceback keeps the model alive (other tests' models take the plain ``model.*``)."""
    try:
        yield
    finally:
        lm.detach()


@case("hf.encoder-decoder")
def _() -> object:
    import transformers

    cfg = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2
    )
    return _attach(transformers.T5ForConditionalGeneration(cfg).eval())


@case("hf.mla")
def _() -> object:
    mla = dict(
        head_dim=None, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=4, n_routed_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=16, first_k_dense_replace=2, n_group=1,
        topk_group=1,
    )  # fmt: skip
    return _attach(_hf("DeepseekV3", **mla))


@case("hf.attention-sinks")
def _() -> object:
    return _attach(_hf("GptOss", num_local_experts=2, num_experts_per_tok=1, sliding_window=4))


@case("hf.chunked-attention")
def _() -> object:
    chunked = dict(attention_chunk_size=4, num_local_experts=1, intermediate_size_mlp=64)
    return _attach(_hf("Llama4", **chunked))


@case("hf.non-causal")
def _() -> object:
    return _attach(_hf("Gemma3", use_bidirectional_attention=True))


@case("hf.kv-sharing")
def _() -> object:
    shared = dict(
        num_hidden_layers=4, num_kv_shared_layers=2, sliding_window=4, laurel_rank=4,
        layer_types=["sliding_attention", "full_attention"] * 2, altup_num_inputs=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=64,
        activation_sparsity_pattern=[0.0] * 4,
    )  # fmt: skip
    return _attach(_hf("Gemma3n", **shared))


@case("hf.dynamic-rope")
def _() -> object:
    return _attach(_hf("Llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}))


@case("hf.model-dtype")
def _() -> object:
    return _attach(_hf("Llama", dtype=torch.float64))


@case("hf.already-attached")
def _() -> object:
    lm = _attach(_hf())
    with _detached(lm):
        return _attach(lm.hf)


@case("hf.kv-scales-per-head")
def _() -> object:
    scales = {f"model.layers.0.self_attn.{x}_scale": torch.ones(2) for x in "kv"}
    return _attach(_hf(), kv_scales_from=scales)


@case("hf.hf-cache-double-write")
def _() -> object:
    from transformers import DynamicCache

    lm = _attach(_hf())
    with _detached(lm):
        return lm.hf(torch.tensor([[3, 4]]), cache=DynamicCache(config=lm.config), use_cache=True)


@case("hf.use-cache-double-write")
def _() -> object:
    lm = _attach(_hf())
    with _detached(lm):
        return lm.hf(torch.tensor([[3, 4]]))


@case("hf.batch-not-flat")
def _() -> object:
    lm = _attach(_hf())
    md = lm.allocator.build_batch([("a", 2), ("b", 2)])
    with _detached(lm), lm.forward_context(md):
        return lm.hf(torch.tensor([[3, 4], [5, 6]]), use_cache=False)


@case("hf.generate-right-padding")
def _() -> object:
    ids, mask = torch.tensor([[3, 4, 0], [5, 6, 7]]), torch.tensor([[1, 1, 0], [1, 1, 1]])
    with _detached(lm := _attach(_hf())):
        return lm.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


@case("hf.generate-empty-prompt")
def _() -> object:
    with _detached(lm := _attach(_hf())):
        return lm.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2, do_sample=False)


@case("hf.generate-beam-search")
def _() -> object:
    ids = torch.tensor([[3, 4, 5]])
    with _detached(lm := _attach(_hf())):
        return lm.generate(ids, num_beams=2, max_new_tokens=3, do_sample=False)


# --- tensor parallelism ---------------------------------------------------------------------------


def _tp(rank: int, size: int):
    from torch_kvq.distributed import TensorParallel

    return TensorParallel(rank, size)


def _tp_model(size: int, **kw: object):
    from torch_kvq.models import build_model

    return build_model("llama-tiny", KVCacheConfig("fp8", skip_layers=(0,)), tp=_tp(0, size), **kw)


@case("tp.heads-not-divisible")
def _() -> object:
    return _tp_model(3)


@case("tp.kv-heads-not-divisible")
def _() -> object:
    return _tp_model(4)


@case("tp.hf-kv-heads-not-divisible")
def _() -> object:
    return _attach(_hf(), tp=_tp(0, 2))


@case("tp.hf-fused-qkv")
def _() -> object:
    return _attach(_hf("Phi3"), tp=_tp(0, 1))


@case("tp.ranks-disagree")
def _() -> object:
    from torch_kvq.distributed import compare_tables, rank_table
    from torch_kvq.models import build_model

    tables = []
    for skip in ((0,), (0, 1)):
        model = build_model("llama-tiny", KVCacheConfig("fp8", skip_layers=skip), prefix="tp")
        tables.append(rank_table(model.global_kv_specs, model.kernel))
        del model
    return compare_tables(tables)


def _agree_seen_from_rank1(views: list, error: object = None, signature: object = None) -> object:
    """``agree`` on rank 1 of 2, the other ranks' views given (the gather mocked; the real
    two-process run is tests/distributed/test_tp.py::test_ranks_refuse_together)."""
    from torch_kvq import distributed

    with mock.patch.object(distributed, "gather", return_value=views):
        return distributed.agree(_tp(1, 2), error, "batch", signature)


@case("tp.rank-refused")
def _() -> object:
    msg = "OutOfPagesError: out of KV pages: the batch needs 2 new pages"
    return _agree_seen_from_rank1([(msg, "None"), (None, "None")])


@case("tp.batch-differs")
def _() -> object:
    return _agree_seen_from_rank1([(None, "[1, 1]"), (None, "[1, 1, 1]")], signature=[1, 1, 1])


@case("tp.rank-without-gpu")
def _() -> object:
    import os

    from torch_kvq.distributed import init_tensor_parallel

    with mock.patch.dict(os.environ, {"LOCAL_RANK": "1", "RANK": "1"}):
        with mock.patch("torch.cuda.is_available", return_value=True):
            with mock.patch("torch.cuda.device_count", return_value=1):
                return init_tensor_parallel("nccl", "cuda")


@case("tp.size-zero")
def _() -> object:
    return _tp(0, 0)


@case("tp.rank-out-of-range")
def _() -> object:
    return _tp(2, 2)


@case("tp.fused-weights")
def _() -> object:
    from torch_kvq.models import build_model, randomize_weights_

    model = build_model("llama-tiny", KVCacheConfig("fp8"))
    model.fuse_projections()
    return randomize_weights_(model, 0, tp=_tp(0, 2))


# --- per-layer modes and the per-(token, head) modes ---------------------------------------------


def _resolve(**kw) -> object:
    return resolve_layer_specs(KVCacheConfig(**{"kv_cache_dtype": "auto", **kw}), infos(4))


@case("modes.unknown-mode")
def _() -> object:
    return KVCacheConfig(layer_modes=((0, "int2_per_token_head"),))


@case("modes.rule-not-a-pair")
def _() -> object:
    return KVCacheConfig(layer_modes=((0,),))


@case("modes.rule-duplicate")
def _() -> object:
    return KVCacheConfig(layer_modes=((0, "fp8"), (0, "auto")))


@case("modes.rules-conflict")
def _() -> object:
    return _resolve(layer_modes=(("sliding_window", "auto"), (0, "fp8")))


@case("modes.rule-conflicts-with-skip")
def _() -> object:
    return _resolve(skip_layers=("sliding_window",), layer_modes=((0, "int8_per_token_head"),))


@case("modes.glob-matches-nothing")
def _() -> object:
    return _resolve(layer_modes=(("decoder.*", "fp8"),))


@case("modes.index-out-of-range")
def _() -> object:
    return _resolve(layer_modes=((4, "fp8"),))


@case("modes.per-tensor-scales-for-per-token-head")
def _() -> object:
    return _resolve(kv_cache_dtype="int8_per_token_head", kv_scales={0: (0.5, 0.5)})


@case("modes.kv-map-not-rule-mode")
def _() -> object:
    from torch_kvq.cli.args import kv_map

    return kv_map("0-3")


@case("modes.kv-map-empty-range")
def _() -> object:
    from torch_kvq.cli.args import kv_map

    return kv_map("3-1:fp8")


@case("modes.kv-map-conflict")
def _() -> object:
    return kvq(
        "inspect",
        "--kv-cache-dtype",
        "auto",
        "--kv-map",
        "0-2:fp8,full_attention:int8_per_token_head",
    )


def pth_env(mode: str = "int8_per_token_head") -> Env:
    """``env`` with layer 1 in a per-(token, head) mode (layer 0 skipped)."""
    specs = resolve_layer_specs(
        KVCacheConfig(mode, skip_layers=(0,), page_size=PAGE), infos(2, f"p{next(_uid)}")
    )
    e = env()
    return replace(e, specs=specs, attns=[Attention(s, 8) for s in specs])


@case("modes.quantize-unknown-format")
def _() -> object:
    return ops.quantize_per_token_head(torch.zeros(2, 8), "int2")


@case("modes.write-unknown-rounding")
def _() -> object:
    e = pth_env()
    a = e.attns[1]
    with e.ctx():
        return ops.quant_cache_write_per_token_head(
            e.k, e.v, a.kv_cache, a.kv_scale, e.specs[1].name, "half_up"
        )


@case("modes.per-token-head-op-on-fp8-layer")
def _() -> object:
    e, p = env(), pth_env()
    with e.ctx():
        return ops.paged_attention_per_token_head(
            e.q, e.attns[1].kv_cache, p.attns[1].kv_scale, e.specs[1].name
        )


@case("modes.kv-scale-shape")
def _() -> object:
    e = pth_env()
    a = e.attns[1]
    with e.ctx():
        scale = a.kv_scale.transpose(2, 3).contiguous()
        return ops.paged_attention_per_token_head(e.q, a.kv_cache, scale, e.specs[1].name)


class DequantOfAnotherMode(HandGraph):
    """Hand-written graph: the per-tensor dequantize on a per-(token, head) layer's codes."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        cache = self.attn.kv_cache.to(FP8_DTYPE)
        kv = ops.dequantize_kv_cache(cache, 1.0, 1.0, torch.float32, self.attn.layer_name)
        return ops.paged_attention(q, kv, self.attn.layer_name)


@case("modes.graph-op-of-another-mode")
def _() -> object:
    e = pth_env()
    return DequantOfAnotherMode(e.specs[1]).run(e.md, e.q)


@case("modes.flashinfer-per-token-head")
def _() -> object:
    spec = resolve_layer_specs(
        KVCacheConfig("int8_per_token_head"),
        [AttentionLayerInfo(f"fi{next(_uid)}.attn", HEADS, KV_HEADS, 64)],
    )[0]
    with fake_gpu(arch=(8, 9)):  # the per-token decode is built for sm90 only
        return FlashInferKernel(prefill="fa2").check_supported(spec)


@case("modes.preset-unknown")
def _() -> object:
    from torch_kvq.kv_presets import kv_preset

    return kv_preset("int3-recommended")


@case("modes.preset-unmeasured-model")
def _() -> object:
    from torch_kvq.kv_presets import kv_preset

    return kv_preset("int4-recommended", model="llama-3.1-8b")


@case("modes.preset-options")
def _() -> object:
    from torch_kvq.evaluation.kv_arg import parse_kv

    return parse_kv("int4-recommended:skip=0")


@case("modes.preset-tc4-options")
def _() -> object:
    from torch_kvq.evaluation.kv_arg import parse_kv

    return parse_kv("tc4-recommended:channels=calibrate")


@case("modes.preset-no-sensitive-layers")
def _() -> object:
    from torch_kvq.kv_presets import kv_preset

    return kv_preset("tc4-recommended", sensitive_layers=[0])


@case("modes.preset-tc4-without-bases")
def _() -> object:
    from torch_kvq.kv_presets import kv_preset

    cfg = kv_preset("tc4-recommended")
    return resolve_layer_specs(cfg, [AttentionLayerInfo("l0.attn", 4, 2, 64)])


def _channel(kh: int = KV_HEADS, d: int = 64, mean: bool = True) -> object:
    from torch_kvq.spec_channels import KChannelScale

    return KChannelScale(torch.ones(kh, d), torch.zeros(kh, d) if mean else None)


@case("modes.k-channels-wrong-mode")
def _() -> object:
    layer = AttentionLayerInfo(f"kc{next(_uid)}.attn", HEADS, KV_HEADS, 64)
    return resolve_layer_specs(KVCacheConfig("fp8", k_channel_scales={0: _channel()}), [layer])


@case("modes.k-channels-shape")
def _() -> object:
    layer = AttentionLayerInfo(f"kc{next(_uid)}.attn", HEADS, 2, 64)
    cfg = KVCacheConfig("int4_per_token_head", k_channel_scales={0: _channel(2, 16)})
    return resolve_layer_specs(cfg, [layer])


@case("modes.k-channels-centred-soft-cap")
def _() -> object:
    layer = AttentionLayerInfo(f"kc{next(_uid)}.attn", HEADS, KV_HEADS, 64, logits_soft_cap=30.0)
    cfg = KVCacheConfig("int4_per_token_head", k_channel_scales={0: _channel()})
    return resolve_layer_specs(cfg, [layer])


@case("modes.k-channels-bad-scale")
def _() -> object:
    from torch_kvq.spec_channels import KChannelScale

    return KChannelScale([[1.0, 0.0]])


@case("modes.k-channels-missing-layer")
def _() -> object:
    model = _hf()
    cfg = model.config
    kh, d = cfg.num_key_value_heads, cfg.head_dim
    only0 = {"model.layers.0.self_attn.k_channel_scale": torch.ones(kh, d)}
    from torch_kvq.integrations.transformers import KVQCausalLM

    return KVQCausalLM.from_hf(
        model, KVCacheConfig("int4_per_token_head", page_size=4), num_pages=16,
        k_channels_from=only0,
    )  # fmt: skip


@case("modes.k-channels-no-int4-layer")
def _() -> object:
    from torch_kvq.cli.eval import with_channels
    from torch_kvq.evaluation.kv_arg import parse_kv

    lm = _attach(_hf())
    with _detached(lm):
        kv = parse_kv("fp8:channels=calibrate")
        return with_channels(lm, None, kv, kv.config(4), None, {"K channel scales": {}})


@case("modes.k-channels-no-file")
def _() -> object:
    from torch_kvq.evaluation.kv_arg import parse_kv

    return parse_kv("int4_per_token_head:channels=/no/such.safetensors")


@case("modes.int4-odd-head-size")
def _() -> object:
    layer = AttentionLayerInfo(f"i4{next(_uid)}.attn", HEADS, KV_HEADS, 15)
    return resolve_layer_specs(KVCacheConfig("int4_per_token_head"), [layer])


@case("modes.int4-torch-quant-form")
def _() -> object:
    layer = AttentionLayerInfo(f"i4{next(_uid)}.attn", HEADS, KV_HEADS, D)
    spec = resolve_layer_specs(KVCacheConfig("int4_per_token_head", page_size=PAGE), [layer])[0]
    return Attention(spec, 4, quant_form="torch")


def k8v4_spec(head_size: int = 128, page: int = 16) -> object:
    layer = AttentionLayerInfo(f"k8v4{next(_uid)}.attn", HEADS, KV_HEADS, head_size)
    return resolve_layer_specs(KVCacheConfig("k8v4_per_token_head", page_size=page), [layer])[0]


@case("modes.k8v4-flashinfer")
def _() -> object:
    with fake_gpu(arch=(8, 9)):  # the k8v4 decode and scratch are built for sm90 only
        return FlashInferKernel().check_supported(k8v4_spec())


def _basis(kh: int = KV_HEADS, d: int = D) -> object:
    from torch_kvq.spec_channels import KBasis

    return KBasis.of(torch.eye(d).expand(kh, d, d))


@case("modes.tc4-no-basis")
def _() -> object:
    layer = AttentionLayerInfo(f"tc{next(_uid)}.attn", HEADS, KV_HEADS, D)
    return resolve_layer_specs(KVCacheConfig("tc4_per_token_head"), [layer])


@case("modes.tc4-head-size")
def _() -> object:
    layer = AttentionLayerInfo(f"tc{next(_uid)}.attn", HEADS, KV_HEADS, 40)
    cfg = KVCacheConfig("tc4_per_token_head", k_bases={0: _basis(d=40)})
    return resolve_layer_specs(cfg, [layer])


@case("modes.tc4-basis-wrong-mode")
def _() -> object:
    layer = AttentionLayerInfo(f"tc{next(_uid)}.attn", HEADS, KV_HEADS, D)
    return resolve_layer_specs(KVCacheConfig("int4_per_token_head", k_bases={0: _basis()}), [layer])


@case("modes.tc4-basis-shape")
def _() -> object:
    layer = AttentionLayerInfo(f"tc{next(_uid)}.attn", HEADS, KV_HEADS, D)
    cfg = KVCacheConfig("tc4_per_token_head", k_bases={0: _basis(kh=1)})
    return resolve_layer_specs(cfg, [layer])


@case("modes.tc4-basis-no-file")
def _() -> object:
    from torch_kvq.evaluation.kv_arg import parse_kv

    return parse_kv("tc4_per_token_head:basis=/some/file")


@case("modes.tc4-basis-no-tc4-layer")
def _() -> object:
    from torch_kvq.cli.eval import with_channels
    from torch_kvq.evaluation.kv_arg import parse_kv

    lm = _attach(_hf())
    with _detached(lm):
        kv = parse_kv("fp8:basis=calibrate")
        return with_channels(lm, None, kv, kv.config(4), None, {"K bases": {}})


@case("modes.tc4-basis-dtype")
def _() -> object:
    from torch_kvq.attention.k_basis import basis_operand, basis_qk

    pair = basis_operand(torch.eye(16).expand(2, 16, 16), torch.bfloat16)  # a bf16 model's
    q, k = torch.zeros(3, 4, 16, dtype=torch.float16), torch.zeros(3, 2, 16, dtype=torch.float16)
    return basis_qk(q, k, pair, pair)


def _tc4_spec(soft_cap: float | None = None, page: int = 16) -> object:
    layer = AttentionLayerInfo(
        f"tc{next(_uid)}.attn", HEADS, KV_HEADS, 128, logits_soft_cap=soft_cap
    )
    cfg = KVCacheConfig("tc4_per_token_head", page_size=page, k_bases={0: _basis(d=128)})
    return resolve_layer_specs(cfg, [layer])[0]


@case("modes.tc4-flashinfer")
def _() -> object:
    with fake_gpu(arch=(8, 9)):  # its decode program and scratch are claimed for sm90 only
        return FlashInferKernel().check_supported(_tc4_spec())


@case("modes.tc4-flashinfer-soft-cap")
def _() -> object:
    with fake_gpu(arch=(9, 0)):
        return FlashInferKernel().check_supported(_tc4_spec(soft_cap=30.0))


@case("modes.tc4-flashinfer-page")
def _() -> object:
    with fake_gpu(arch=(9, 0)):
        return FlashInferKernel().check_supported(_tc4_spec(page=128))


# --- the tests ----------------------------------------------------------------------------------


def _message(exc: BaseException) -> str:
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])  # str(KeyError) is the repr of its message
    return str(exc)


def _matches(excerpt: str, message: str) -> bool:
    pattern = ".*?".join(re.escape(part.strip()) for part in excerpt.split("..."))
    return re.search(pattern, message, re.S) is not None


def test_doc_and_cases_agree() -> None:
    rows = doc_rows()
    assert not sorted(set(rows) - set(CASES)), "docs/errors.md rows without a test thunk"
    assert not sorted(set(CASES) - set(rows)), "test thunks without a docs/errors.md row"
    assert len(rows) >= 30


@pytest.mark.parametrize("case_id", sorted(set(doc_rows()) | set(CASES)))
def test_rejected_input(case_id: str) -> None:
    row = doc_rows().get(case_id)
    thunk = CASES.get(case_id)
    assert row is not None, f"{case_id}: no row in docs/errors.md"
    assert thunk is not None, f"{case_id}: no thunk in tests/test_errors.py"
    with pytest.raises(Exception) as info:  # noqa: B017  (type checked exactly below)
        thunk()
    got = type(info.value).__name__
    msg = _message(info.value)
    assert got == row.exc, f"{case_id}: raised {got}: {msg}; docs/errors.md says {row.exc}"
    assert _matches(row.excerpt, msg), f"{case_id}: message {msg!r} lacks {row.excerpt!r}"
