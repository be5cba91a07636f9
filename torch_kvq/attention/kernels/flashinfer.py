"""FlashInfer paged attention behind the ``kvq::*`` ops (GPU only).

Per batch, outside the graph, ``plan`` groups the layers by everything a FlashInfer plan bakes in
(phase, window, kv dtype, q dtype, soft-cap, sm_scale, heads, head size) and plans each group once;
``attend`` (inside the ops) only runs. Kernels per layer, chosen from the layer's spec:

* prefill / mixed batch: ``BatchPrefillWithPagedKVCacheWrapper``, the ``prefill`` option
  (H200, 8 prompts x 16k, QH=32 KH=8 D=128, per layer; benchmarks/RESULTS.md):

  - ``"fa2"`` (default): bf16 q + bf16 cache (49.6 ms), or bf16 q + FP8 cache read in place
    (``k_scale`` folded into sm_scale, ``v_scale`` on the output; 61.6 ms, 0.81x).
  - ``"fa3"``: model-dtype layers on the Hopper fa3 kernel (31.5 ms, 1.57x fa2); FP8 layers stay
    on fa2 (fa3 has no bf16-query / FP8-cache kernel). sm90 only.
  - ``"fa3_fp8"``: as ``"fa3"``, and FP8 layers on fa3's FP8 kernel with the query quantized per
    tensor inside ``attend`` (``quantize_query``; the scale is read on the host: one sync per FP8
    layer per prefill): 24.3 ms (2.04x fa2 bf16, 1.30x fa3 bf16), but both products run in e4m3,
    relative error 3.8e-2 against fp32 on the same cache (fa2: 2.3e-3). Opt in knowingly, like
    XQA. Time to first token, Llama-3.1-8B shape, 8 x 16k: 3.85 s against 4.08 s all-bf16 on fa3
    (1.06x). FlashInfer 0.6.18's FP8 mainloop masks the raw code logits q8.k8 with a finite -5e4
    (its issue #4267; on the H200 the error follows the masked key's real logit: 0.72 at -1.8,
    0.87 at -0.45), so ``quantize_query`` floors the query scale to keep a masked key >= 100
    below in real logit units (1.8e-2 then); FP8 layers with a logit soft-cap are refused (that
    kernel has none).
* decode-only batch, model-dtype cache: ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores)``.
* decode-only batch, FP8 cache, the ``fp8_decode`` option (H200, QH=32 KH=8 D=128, bs 32 x 16k;
  benchmarks/RESULTS.md has the dates, commands and the other shapes):

  - ``"tensor_cores"`` (default): the same wrapper, the cache widened in registers. With
    ``fp8_decode_math="fp16"`` (default) the query is cast to fp16 and both products run in fp16
    (e4m3 -> fp16 is one conversion per two values on sm90, e4m3 -> bf16 three or four): 0.380
    ms (66% of copy bandwidth), relative error 1.7e-3; with ``"model"`` (bf16 math) 0.427 ms
    (59%), 2.3e-3. fp16's range ends at 65504: a query element beyond it becomes inf (and the output
    NaN), never silently clipped; use ``"model"`` for such models.
  - ``"xqa"``: ``trtllm_batch_decode_with_kv_cache(backend="xqa")``, Hopper FP8-MMA kernel.
    0.257 ms (98% of copy bandwidth; 0.27-0.33 ms, bimodal, with PDL on: ``xqa_pdl``) and
    writes FP8 output, but both GEMMs run in FP8 (q and the softmax weights rounded to e4m3): relative error 3.7e-2 on random data,
    6.7e-2 with peaked attention, and with V of non-zero mean an output shrink that grows with
    context (-0.4% at 1k, -2.3% at 4k, -10% at 16k). Opt in knowingly.
  - ``"triton"``: our Triton kernel (``triton_decode_tma``: one TMA box per cache page, one warp
    per program, split-K, or the balanced schedule at large batches), XQA's dense block table,
    the cache widened to fp16 in registers (``fp8_decode_math``: "model" widens to the model
    dtype): Llama's head 128 at 32 x 16k 0.268 ms (94% of copy bandwidth), relative error
    1.7e-3; Gemma-3's head 256: 100% (runs 35 and 41 of 2026-12-01). sm90 only (the arch it was
    measured on).

What a configuration serves (archs, q dtypes, head sizes, XQA's page sizes and soft-cap) is the
capability table's row for its ``name`` on the GPU's arch (kernels/capabilities.py): the
``check_supported`` here and the fusion passes read that one table.

Shapes: q [T, QH, D] in the layer's model dtype; cache [pages, 2, page_size, KH, D] (NHD);
output [T, QH, D] in the model dtype, or float8_e4m3fn (``out / output_scale``) on XQA decode.
Sliding window: our query at p sees keys p - window < k <= p, FlashInfer's
``window_left = window - 1``. ``import flashinfer`` happens only here, lazily, on first plan.

CUDA graphs (``ctx.graph`` set, decode only): each (group, graph shape) gets its own wrapper
built with ``use_cuda_graph=True`` and fixed page-table buffers, and XQA gets a fixed block
table [batch, max_pages_per_seq]; every plan for that shape refills them in place, so a graph
captured once replays for any batch of that shape (``DecodeGraphRunner``).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import torch

from torch_kvq.attention.kernels import capabilities as caps
from torch_kvq.attention.kernels import flashinfer_xqa as xqa
from torch_kvq.attention.kernels.base import KernelUnsupportedError
from torch_kvq.attention.metadata import GraphShape
from torch_kvq.spec import FP8_DTYPE, LayerKVSpec

if TYPE_CHECKING:
    from torch_kvq.attention.context import ForwardContext
    from torch_kvq.attention.metadata import BatchMetadata


def import_flashinfer(module: str = "flashinfer") -> ModuleType:
    """``import flashinfer`` (or one of its modules), or a ``KernelUnsupportedError`` saying what
    to install: FlashInfer is an optional extra (``pip install 'torch-kvq[flashinfer]'``)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise KernelUnsupportedError(
            f"the FlashInfer kernel needs flashinfer-python ({module} cannot be imported: {e}); "
            "install it with pip install 'torch-kvq[flashinfer]' on a machine with a CUDA build "
            "of torch"
        ) from e


FP8Decode = Literal["tensor_cores", "xqa", "triton"]
Phases = Literal["any", "decode"]
Prefill = Literal["fa2", "fa3", "fa3_fp8"]
FP8DecodeMath = Literal["fp16", "model"]
_KERNEL_OF = {"fa2-prefill": "prefill", "fa3-prefill": "prefill", "fa3-fp8-prefill": "prefill",
              "tc-decode": "decode", "xqa-decode": "xqa", "triton-decode": "triton"}  # fmt: skip
FA3_FP8_SENTINEL = 5e4  # FlashInfer 0.6.18 math::inf, the FP8 mainloop's mask value in code units
FA3_FP8_MASK_MARGIN = 100.0  # how far below (in real logit units) a masked key must sit
DEFAULT_WORKSPACE_BYTES = 256 * 1024 * 1024
_generation = itertools.count(1)


@dataclass(frozen=True)
class GroupKey:
    """Everything one FlashInfer plan bakes in; layers with equal keys share one plan."""

    kernel: str  # "prefill" | "decode" | "xqa" | "triton"
    backend: str  # "fa2" | "fa3" (FlashInfer's wrapper backend; "fa2" for XQA)
    window: int | None
    kv_dtype: torch.dtype
    q_dtype: torch.dtype  # what the kernel reads: the model dtype, fp16 or float8_e4m3fn
    o_dtype: torch.dtype  # always the layer's model dtype
    soft_cap: float | None
    sm_scale: float
    num_heads: int
    num_kv_heads: int
    head_size: int


@dataclass(frozen=True)
class GroupPlan:
    key: GroupKey
    wrapper: Any  # a FlashInfer wrapper; None for XQA and Triton (planless)
    generation: int


class FlashInferKernel:
    """FlashInfer kernels for bf16 and FP8-KV layers. Raises, never falls back, when it cannot serve.

    Args:
        fp8_decode: kernel for FP8-cache layers on decode-only batches (see module docstring).
        phases: ``"any"`` serves prefill, mixed and decode batches; ``"decode"`` promises (and
            checks at plan time) decode-only batches, so a graph compiled for it may fuse the
            output quant on layers whose decode kernel writes FP8 (``fp8_output_supported``).
            ``name`` ("flashinfer[-xqa][-decode]") is this configuration's capability-table key.
        unfused_attention: also plan the model-dtype attention of FP8 layers, so the readable
            unfused form (dequantize the cache, then ``paged_attention``) runs too. Set False for
            fused-only graphs to save a plan per group.
        workspace_bytes: float workspace shared by all wrappers (and the XQA scratch, separately).
        xqa_pdl: launch XQA with programmatic dependent launch. Off by default: with it on, back
            to back XQA calls at 32 x 16k took 0.27 or 0.32 ms (bimodal, 80% of copy bandwidth
            median); with it off 0.257 ms every time (98%) (benchmarks/RESULTS.md, issue 14).
        prefill: the prefill / mixed-batch kernels, ``"fa2"``, ``"fa3"`` or ``"fa3_fp8"`` (module
            docstring). ``"fa3*"`` need sm90 and ``phases="any"``.
        fp8_decode_math: ``"fp16"`` or ``"model"``: the math dtype of the tensor-core decode of
            FP8 layers, and of the Triton one (module docstring). No effect on XQA or on fp16 models.
    """

    supports_cuda_graphs = True

    def __init__(
        self,
        fp8_decode: FP8Decode = "tensor_cores",
        phases: Phases = "any",
        unfused_attention: bool = True,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        xqa_pdl: bool = False,
        prefill: Prefill = "fa2",
        fp8_decode_math: FP8DecodeMath = "fp16",
    ) -> None:
        if fp8_decode not in ("tensor_cores", "xqa", "triton"):
            raise ValueError(
                f"fp8_decode {fp8_decode!r} unknown; expected 'tensor_cores', 'xqa' or 'triton'"
            )
        if phases not in ("any", "decode"):
            raise ValueError(f"phases {phases!r} unknown; expected 'any' or 'decode'")
        if prefill not in ("fa2", "fa3", "fa3_fp8"):
            raise ValueError(f"prefill {prefill!r} unknown; expected 'fa2', 'fa3' or 'fa3_fp8'")
        if prefill != "fa2" and phases == "decode":
            raise ValueError(
                f"prefill={prefill!r} with phases='decode': a decode-only kernel runs no prefill; "
                "use phases='any'"
            )
        if fp8_decode_math not in ("fp16", "model"):
            raise ValueError(
                f"fp8_decode_math {fp8_decode_math!r} unknown; expected 'fp16' or 'model'"
            )
        if (
            isinstance(workspace_bytes, bool)
            or not isinstance(workspace_bytes, int)
            or workspace_bytes < 2**24
        ):
            raise ValueError(f"workspace_bytes must be an int >= 16 MiB, got {workspace_bytes!r}")
        self.fp8_decode: FP8Decode = fp8_decode
        self.phases: Phases = phases
        # the capability-table name of this configuration (kernels/capabilities.py)
        self.name = (
            "flashinfer"
            + ("" if fp8_decode == "tensor_cores" else f"-{fp8_decode}")
            + ("-decode" if phases == "decode" else "")
        )
        self.unfused_attention = unfused_attention
        self.workspace_bytes = workspace_bytes
        self.xqa_pdl = bool(xqa_pdl)
        self.prefill: Prefill = prefill
        self.fp8_decode_math: FP8DecodeMath = fp8_decode_math
        self._device: torch.device | None = None
        self._float_ws: torch.Tensor | None = None
        self._xqa_ws: torch.Tensor | None = None
        self._wrappers: dict[tuple[GroupKey, GraphShape | None], Any] = {}
        self._xqa_graph_tables: dict[tuple[int | None, GraphShape], torch.Tensor] = {}
        self._reasons: dict[LayerKVSpec, str | None] = {}
        self._planned_gen: dict[GroupKey, int] = {}

    def __repr__(self) -> str:
        extra = "" if self.prefill == "fa2" else f", prefill={self.prefill!r}"
        if self.fp8_decode_math != "fp16":
            extra += f", fp8_decode_math={self.fp8_decode_math!r}"
        return f"FlashInferKernel(fp8_decode={self.fp8_decode!r}, phases={self.phases!r}{extra})"

    # -- support -------------------------------------------------------------------------------

    def check_supported(self, spec: LayerKVSpec) -> None:
        """Raise ``KernelUnsupportedError`` naming the layer and the reason."""
        why = self._unsupported_reason(spec)
        if why:
            raise KernelUnsupportedError(f"layer {spec.name!r}: {self!r} cannot serve it: {why}")

    def _unsupported_reason(self, spec: LayerKVSpec) -> str | None:
        """Memoized per spec: every input (spec, GPU, this configuration) is fixed for a process,
        and this runs for every layer on every step."""
        try:
            return self._reasons[spec]
        except KeyError:
            why = self._reasons[spec] = self._find_unsupported_reason(spec)
            return why

    def arch(self) -> str:
        """The arch this kernel runs on: its device's once planned, else the current CUDA device's."""
        return caps.device_arch(self._device or torch.device("cuda"))

    def _find_unsupported_reason(self, spec: LayerKVSpec) -> str | None:
        """The capability table's answer (kernels/capabilities.py) for this configuration's name
        on this GPU's arch; an arch without a row is refused, naming the archs that have one."""
        if not torch.cuda.is_available():
            return "FlashInfer needs a CUDA GPU and torch.cuda.is_available() is False"
        arch = self.arch()
        try:
            why = caps.unsupported_reason(self.name, arch, spec)
        except ValueError as e:  # no row for this arch
            return str(e)
        if (
            why is None
            and self.prefill == "fa3_fp8"
            and spec.is_quantized
            and spec.logits_soft_cap
            and self.phases == "any"
        ):
            return (
                "a logit soft-cap is not supported by fa3's FP8 prefill kernel (prefill='fa3_fp8'); "
                "FlashInferKernel(prefill='fa3') serves it (FP8 layers on fa2)"
            )
        if why is None and self.fp8_decode == "triton" and spec.is_quantized:
            if importlib.util.find_spec("triton") is None:
                return (
                    "fp8_decode='triton' needs Triton (pip install triton), which is not installed"
                )
        if why is None and self.prefill != "fa2" and arch != "sm90":
            return (
                f"prefill={self.prefill!r} runs FlashInfer's fa3 kernels, which are built for sm90 "
                f"only, and this GPU is {arch}; FlashInferKernel(prefill='fa2') serves it"
            )
        if why is None:
            return None
        if self.fp8_decode != "tensor_cores" and spec.is_quantized:
            plain = self.name.replace(f"-{self.fp8_decode}", "")
            if caps.unsupported_reason(plain, arch, spec) is None:
                why += f"; FlashInferKernel(fp8_decode='tensor_cores', phases={self.phases!r}) serves it"
        return f"{why} (capability row {self.name!r} on {arch})"

    def fp8_output_supported(self, spec: LayerKVSpec) -> bool:
        """True if the capability table says this kernel configuration writes FP8 output for
        ``spec`` on this GPU in every phase it serves (so the passes may fuse the output quant)."""
        if self._unsupported_reason(spec):
            return False
        return caps.supports(self.name, self.arch(), spec.mode, spec.model_dtype, True)

    def variant(self, spec: LayerKVSpec, phase: str, kv_dtype: torch.dtype | None = None) -> str:
        """Which FlashInfer kernel serves ``spec`` in ``phase`` ("prefill" | "decode")."""
        kv_dtype = spec.storage_dtype if kv_dtype is None else kv_dtype
        if phase == "prefill":
            # fa3 has no kernel for a model-dtype query over an FP8 cache: with "fa3" those stay
            # on fa2; "fa3_fp8" quantizes the query for fa3's FP8 kernel
            if self.prefill == "fa2" or (kv_dtype == FP8_DTYPE and self.prefill == "fa3"):
                return "fa2-prefill"
            return "fa3-fp8-prefill" if kv_dtype == FP8_DTYPE else "fa3-prefill"
        if kv_dtype == FP8_DTYPE and self.fp8_decode != "tensor_cores":
            return f"{self.fp8_decode}-decode"
        return "tc-decode"

    # -- plan ----------------------------------------------------------------------------------

    def _group_key(self, spec: LayerKVSpec, kv_dtype: torch.dtype, decode: bool) -> GroupKey:
        variant = self.variant(spec, "decode" if decode else "prefill", kv_dtype)
        q_dtype = spec.model_dtype
        if variant == "fa3-fp8-prefill":
            q_dtype = FP8_DTYPE
        elif (
            variant in ("tc-decode", "triton-decode")
            and kv_dtype == FP8_DTYPE
            and self.fp8_decode_math == "fp16"
        ):
            q_dtype = torch.float16
        return GroupKey(
            kernel=_KERNEL_OF[variant],
            backend="fa3" if variant.startswith("fa3") else "fa2",
            window=spec.sliding_window,
            kv_dtype=kv_dtype,
            q_dtype=q_dtype,
            o_dtype=spec.model_dtype,
            soft_cap=spec.logits_soft_cap or None,
            sm_scale=spec.sm_scale,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
        )

    def _buffers(self, device: torch.device) -> None:
        if self._device is not None and self._device != device:
            raise KernelUnsupportedError(
                f"{self!r} was first used on {self._device} and now gets a batch on {device}; "
                "use one FlashInferKernel per device"
            )
        if self._float_ws is None:
            self._device = device
            self._float_ws = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)

    def plan(self, ctx: ForwardContext, specs: list[LayerKVSpec]) -> None:
        """Plan one wrapper per group of ``specs`` for ``ctx.metadata``; store them in ctx.plans."""
        md = ctx.metadata
        decode = md.is_decode_only
        if self.phases == "decode" and not decode:
            raise KernelUnsupportedError(
                f"{self!r} was built for decode-only batches (its graphs may write FP8 attention "
                f"output that no prefill kernel can), but got a batch with query lengths "
                f"{sorted(set(md.qo_lens))[:4]}; plan prefill with a phases='any' kernel"
            )
        if ctx.graph is not None and not decode:
            raise KernelUnsupportedError(
                f"{self!r}: CUDA graphs serve decode-only batches, got query lengths "
                f"{sorted(set(md.qo_lens))[:4]}"
            )
        device = md.kv_indices.device
        if device.type != "cuda":
            raise KernelUnsupportedError(
                f"{self!r}: batch metadata is on {device}, expected a CUDA device"
            )
        for spec in specs:
            self.check_supported(spec)
        self._buffers(device)
        layers: dict[tuple[str, torch.dtype], GroupKey] = {}
        for spec in specs:
            dtypes = [spec.storage_dtype]
            if spec.is_quantized and self.unfused_attention:
                dtypes.append(spec.model_dtype)  # the unfused form attends on the dequantized cache
            for kv_dtype in dtypes:
                layers[(spec.name, kv_dtype)] = self._group_key(spec, kv_dtype, decode)
        hosts: dict[int | None, _HostIndptrs] = {}  # per page table (cache group)
        plans: dict[GroupKey, GroupPlan] = {}
        for key in dict.fromkeys(layers.values()):
            gen = next(_generation)
            wrapper = None
            if key.kernel not in ("xqa", "triton"):
                table = md.for_window(key.window)
                host = hosts.get(key.window)
                if host is None:
                    host = hosts[key.window] = _HostIndptrs.build(table)
                graph = None if ctx.graph is None else ctx.graph.for_window(key.window)
                wrapper = self._plan_wrapper(key, table, host, graph)
            self._planned_gen[key] = gen
            plans[key] = ctx.plans[(id(self), key)] = GroupPlan(key, wrapper, gen)
        for (name, kv_dtype), key in layers.items():  # attend's lookup: one dict access
            ctx.plans[(id(self), name, kv_dtype)] = plans[key]
        for window in dict.fromkeys(k.window for k in plans if k.kernel in ("xqa", "triton")):
            graph = None if ctx.graph is None else ctx.graph.for_window(window)
            tables = self._xqa_tables(md.for_window(window), window, graph)
            ctx.plans[(id(self), "xqa_tables", window)] = tables
            if self._xqa_ws is None and self.fp8_decode == "xqa":  # semaphores start at zero
                self._xqa_ws = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)

    def _plan_wrapper(
        self, key: GroupKey, md: BatchMetadata, host: _HostIndptrs, graph: GraphShape | None
    ) -> Any:
        flashinfer = import_flashinfer()
        wrapper = self._wrappers.get((key, graph))
        if wrapper is None:
            if key.kernel == "prefill":
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self._float_ws, "NHD", backend=key.backend
                )
            elif graph is None:
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._float_ws, "NHD", use_tensor_cores=True, backend="fa2"
                )
            else:  # fixed buffers, refilled by every plan for this shape
                b, dev, i32 = graph.batch_size, self._device, torch.int32
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self._float_ws, "NHD", use_tensor_cores=True, backend="fa2",
                    use_cuda_graph=True,
                    paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=i32, device=dev),
                    paged_kv_indices_buffer=torch.zeros(
                        b * graph.max_pages_per_seq, dtype=i32, device=dev
                    ),
                    paged_kv_last_page_len_buffer=torch.zeros(b, dtype=i32, device=dev),
                )  # fmt: skip
            self._wrappers[(key, graph)] = wrapper
        common = dict(
            window_left=-1 if key.window is None else key.window - 1,
            logits_soft_cap=key.soft_cap,
            sm_scale=key.sm_scale,
            q_data_type=key.q_dtype,
            kv_data_type=key.kv_dtype,
            o_data_type=key.o_dtype,
        )
        if key.kernel == "prefill":
            wrapper.plan(
                host.qo_indptr, host.kv_indptr, md.kv_indices, host.last_page_len,
                key.num_heads, key.num_kv_heads, key.head_size, md.page_size,
                causal=True, **common,
            )  # fmt: skip
        else:
            wrapper.plan(
                host.kv_indptr, md.kv_indices, host.last_page_len,
                key.num_heads, key.num_kv_heads, key.head_size, md.page_size, **common,
            )  # fmt: skip
        return wrapper

    def _xqa_tables(
        self, md: BatchMetadata, window: int | None, graph: GraphShape | None
    ) -> xqa.XQATables:
        """XQA's block table for ``window``'s page table (``flashinfer_xqa.block_tables``); under a
        CUDA graph written into that (window, shape)'s fixed buffer, which the graph reads."""
        buffer = None
        if graph is not None:
            buffer = self._xqa_graph_tables.get((window, graph))
            if buffer is None:
                shape = (md.num_seqs, graph.max_pages_per_seq)  # the step's padded batch
                buffer = torch.empty(shape, dtype=torch.int32, device=md.kv_indices.device)
                self._xqa_graph_tables[(window, graph)] = buffer
        return xqa.block_tables(md, graph, buffer)

    # -- run -----------------------------------------------------------------------------------

    def attend(
        self,
        ctx: ForwardContext,
        spec: LayerKVSpec,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        k_scale: float,
        v_scale: float,
        output_scale: float | torch.Tensor | None,
    ) -> torch.Tensor:
        """q [T, QH, D], kv_cache [pages, 2, page, KH, D] -> [T, QH, D] (see module docstring)."""
        plan = ctx.plans.get((id(self), spec.name, kv_cache.dtype))
        if plan is None:
            if kv_cache.dtype not in (spec.storage_dtype, spec.model_dtype):
                raise ValueError(
                    f"layer {spec.name!r}: cache dtype {kv_cache.dtype}, expected "
                    f"{spec.storage_dtype} (its storage) or {spec.model_dtype} (dequantized, unfused)"
                )
            hint = (
                " (the unfused form of an FP8 layer needs FlashInferKernel(unfused_attention=True))"
                if kv_cache.dtype != spec.storage_dtype
                else " (was it in the forward context's specs?)"
            )
            raise KernelUnsupportedError(
                f"layer {spec.name!r} has no FlashInfer plan for a {kv_cache.dtype} cache{hint}"
            )
        key = plan.key
        if self._planned_gen.get(key) != plan.generation:
            raise RuntimeError(
                f"layer {spec.name!r}: the FlashInfer plan of this forward context was replaced by a "
                "later plan of the same FlashInferKernel; nested forward contexts need separate kernels"
            )
        # q may be any view (a transposed [B, H, S, D] one from Hugging Face); the kernels want
        # dense [T, QH, D] rows. The output is always a new contiguous tensor (the ops' fakes say so).
        q = q.contiguous()
        if isinstance(output_scale, torch.Tensor):
            raise KernelUnsupportedError(
                f"layer {spec.name!r}: FlashInfer takes the FP8 output scale as a Python float only "
                "(XQA's o_scale), but the graph passes a tensor (output_scale_tensor); the passes "
                "must not fuse such a quant here (kernels/capabilities.py: tensor_output_scale)"
            )
        if key.kernel == "xqa":
            tables = ctx.plans[(id(self), "xqa_tables", spec.sliding_window)]
            return xqa.run(
                spec, q, kv_cache, tables, self._xqa_ws, k_scale, v_scale, output_scale,
                self.xqa_pdl,
            )  # fmt: skip
        if output_scale is not None:
            variant = {"prefill": f"{key.backend} prefill", "decode": "tensor-core decode"}.get(
                key.kernel, "Triton decode"
            )
            raise KernelUnsupportedError(
                f"layer {spec.name!r}: FlashInfer {variant} cannot write FP8 output, but the graph "
                "asks for it (output_scale given). Only XQA decode does; the passes must not fuse "
                "the output quant here (see kernels/capabilities.py)"
            )
        if key.kernel == "triton":
            tables = ctx.plans[(id(self), "xqa_tables", spec.sliding_window)]
            return _triton_decode(spec, q, kv_cache, tables, k_scale, v_scale, key.q_dtype)
        out = torch.empty(q.shape, dtype=key.o_dtype, device=q.device)
        if kv_cache.dtype != FP8_DTYPE:
            return plan.wrapper.run(q, kv_cache, out=out)
        if key.q_dtype == FP8_DTYPE:  # fa3's FP8 kernel: quantize the query per tensor
            q8, q_scale = quantize_query(q, k_scale * spec.sm_scale)
            return plan.wrapper.run(
                q8, kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out
            )
        q = q.to(key.q_dtype)  # fp16 math (fp8_decode_math), else a no-op
        return plan.wrapper.run(q, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out)


def _triton_decode(
    spec: LayerKVSpec, q: torch.Tensor, kv_cache: torch.Tensor, tables: xqa.XQATables,
    k_scale: float, v_scale: float, dot_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """``fp8_decode="triton"``: q [B, QH, D] over XQA's dense block table -> [B, QH, D] in q's
    dtype, with the measured best configuration for the head size (imports Triton here)."""
    from torch_kvq.attention.kernels import triton_decode_tma as tma

    return tma.paged_decode_tma(
        q, kv_cache, tables.block_tables, tables.seq_lens, k_scale, v_scale, spec.sm_scale,
        max_seq_len=tables.max_seq_len, window=spec.sliding_window,
        soft_cap=spec.logits_soft_cap or None, dot_dtype=dot_dtype, **tma.tuned(spec.head_size),
    )  # fmt: skip


def quantize_query(q: torch.Tensor, k_logit_scale: float) -> tuple[torch.Tensor, float]:
    """q [T, QH, D] -> (e4m3 q / scale, scale) per tensor, for fa3's FP8 prefill kernel.

    scale = max(amax(|q|) / 448, FA3_FP8_MASK_MARGIN / (FA3_FP8_SENTINEL * k_logit_scale)) with
    ``k_logit_scale`` = k_scale * sm_scale: that kernel masks the raw code logits q8.k8 with the
    finite -5e4, which in real logit units is -5e4 * scale * k_logit_scale; the floor keeps it at
    least FA3_FP8_MASK_MARGIN below zero (a larger scale only shrinks the codes; e4m3's relative
    precision holds down to codes of 2**-6). Read on the host: fa3 takes q_scale as a float
    (prefill only, never in a CUDA graph). The cast saturates at +-448."""
    if not k_logit_scale > 0:
        raise ValueError(f"quantize_query: k_scale * sm_scale must be > 0, got {k_logit_scale!r}")
    amax = float(q.abs().amax())
    scale = max(amax / 448.0, FA3_FP8_MASK_MARGIN / (FA3_FP8_SENTINEL * k_logit_scale))
    return (q * (1.0 / scale)).to(FP8_DTYPE), scale


@dataclass(frozen=True)
class _HostIndptrs:
    """CPU copies of the page-table indptrs, built from the metadata's host lists (no device sync)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    last_page_len: torch.Tensor

    @classmethod
    def build(cls, md: BatchMetadata) -> _HostIndptrs:
        qo = [0, *itertools.accumulate(md.qo_lens)]
        kv = [0, *itertools.accumulate(md.pages_per_seq)]
        last = [n - (p - 1) * md.page_size for n, p in zip(md.kv_lens, md.pages_per_seq)]
        i32 = dict(dtype=torch.int32)
        return cls(
            qo_indptr=torch.tensor(qo, **i32),
            kv_indptr=torch.tensor(kv, **i32),
            last_page_len=torch.tensor(last, **i32),
        )
