"""FlashInfer paged attention behind the ``kvq::*`` ops (GPU only).

Per batch, outside the graph, ``plan`` groups the layers by everything a FlashInfer plan bakes in
(``flashinfer_plan.GroupKey``) and plans each group once; ``attend`` (inside the ops) only runs.
Which kernel serves which batch and layer (fa2 / fa3 / fa3_fp8 prefill, the tensor-core decode,
XQA, our Triton decodes, the dequantized scratch for a per-(token, head) or tc4 prefill) is
chosen from the layer's own spec and the options; the table of it is docs/kernels.md, the
measurements docs/design/ and docs/performance.md.

The unfused form of a quantized layer hands ``attend`` its batch's pages dequantized to fp32
(the exact semantics; the rest of that tensor is never written). FlashInfer reads no fp32 cache,
so ``attend`` casts those pages to the model dtype and runs the model-dtype plan on them: the
GPU's unfused form is an approximation within the bf16 path's error class, like every GPU kernel;
the fp32 semantics are the reference kernel's.

What a configuration serves (archs, q dtypes, head sizes, XQA's page sizes and soft-cap) is the
capability table's row for its ``name`` on the GPU's arch (kernels/capabilities.py): the
``check_supported`` here and the fusion passes read that one table (``flashinfer_support`` adds
the limits of the kernels behind a row).

Shapes: q [T, QH, D] in the layer's model dtype; cache [pages, 2, page_size, KH, D] (NHD);
output [T, QH, D] in the model dtype, or float8_e4m3fn (``out / output_scale``) on XQA decode.
Sliding window: our query at p sees keys p - window < k <= p, FlashInfer's
``window_left = window - 1``. FlashInfer is imported only on first plan (``import_flashinfer``).

CUDA graphs (``ctx.graph`` set, decode only): each (group, graph shape) gets its own wrapper with
fixed page-table buffers, and XQA / Triton a fixed block table [batch, max_pages_per_seq]; every
plan for that shape refills them in place, so a graph captured once replays for any batch of
that shape (``DecodeGraphRunner``).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Literal

import torch

from torch_kvq.attention.kernels import capabilities as caps
from torch_kvq.attention.kernels import flashinfer_support as support
from torch_kvq.attention.kernels import flashinfer_xqa as xqa
from torch_kvq.attention.kernels.base import KernelUnsupportedError
from torch_kvq.attention.kernels.flashinfer_fa3_fp8 import quantize_query
from torch_kvq.attention.kernels.flashinfer_plan import (
    GroupKey,
    GroupPlan,
    HostIndptrs,
    plan_wrapper,
)
from torch_kvq.attention.kernels.kv_dequant import batch_pages_as, dequantize_pages
from torch_kvq.attention.kernels.kv_dequant_tc import dequantize_pages_tc
from torch_kvq.attention.metadata import GraphShape
from torch_kvq.spec import LayerKVSpec
from torch_kvq.spec_modes import FP8_DTYPE

if TYPE_CHECKING:
    from torch_kvq.attention.context import ForwardContext


FP8Decode = Literal["tensor_cores", "xqa", "triton"]
Phases = Literal["any", "decode"]
Prefill = Literal["fa2", "fa3", "fa3_fp8"]
FP8DecodeMath = Literal["fp16", "model"]
_KERNEL_OF = {"fa2-prefill": "prefill", "fa3-prefill": "prefill", "fa3-fp8-prefill": "prefill",
              "tc-decode": "decode", "xqa-decode": "xqa", "triton-decode": "triton",
              "fa2-compact-prefill": "compact-prefill",
              "fa3-compact-prefill": "compact-prefill"}  # fmt: skip
# what a per-(token, head) cache stores (uint8: int4_per_token_head's two codes per byte, or
# k8v4_per_token_head's k int8 bytes and v int4 codes)
CODE_DTYPES = (torch.int8, FP8_DTYPE, torch.uint8)
DEFAULT_WORKSPACE_BYTES = 256 * 1024 * 1024
_generation = itertools.count(1)


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
        xqa_pdl: launch XQA with programmatic dependent launch. Off by default: with it on,
            back to back XQA calls took one of two times, the slower one often; with it off the
            faster one every time (benchmarks/RESULTS.md, issue 14).
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
        """The capability table's answer, and this configuration's own limits (flashinfer_support)."""
        if not torch.cuda.is_available():
            return "FlashInfer needs a CUDA GPU and torch.cuda.is_available() is False"
        return support.unsupported_reason(
            self.name, self.arch(), spec, self.prefill, self.phases, self.fp8_decode
        )

    def fp8_output_supported(self, spec: LayerKVSpec) -> bool:
        """True if the capability table says this kernel configuration writes FP8 output for
        ``spec`` on this GPU in every phase it serves (so the passes may fuse the output quant)."""
        if self._unsupported_reason(spec):
            return False
        return caps.supports(self.name, self.arch(), spec.mode, spec.model_dtype, True)

    def variant(self, spec: LayerKVSpec, phase: str, kv_dtype: torch.dtype | None = None) -> str:
        """Which FlashInfer kernel serves ``spec`` in ``phase`` ("prefill" | "decode") for a cache
        of ``kv_dtype`` (default: the layer's storage; the model dtype: the unfused form)."""
        kv_dtype = spec.storage_dtype if kv_dtype is None else kv_dtype
        codes = spec.mode.has_kv_scale
        if codes and kv_dtype == spec.storage_dtype:  # codes + kv_scale (tc4: its side rows)
            if phase == "decode":
                return "triton-decode"
            return "fa2-compact-prefill" if self.prefill == "fa2" else "fa3-compact-prefill"
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
            and kv_dtype in CODE_DTYPES
            and self.fp8_decode_math == "fp16"
        ):
            q_dtype = torch.float16
        if variant.endswith("compact-prefill"):  # FlashInfer reads the model-dtype scratch
            kv_dtype = spec.model_dtype
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
        hosts: dict[int | None, HostIndptrs] = {}  # per page table (cache group)
        plans: dict[GroupKey, GroupPlan] = {}
        for key in dict.fromkeys(layers.values()):
            gen = next(_generation)
            wrapper = None
            if key.kernel not in ("xqa", "triton"):
                table = md.for_window(key.window)
                host = hosts.get(key.window)
                if host is None:
                    host = hosts[key.window] = HostIndptrs.build(table)
                graph = None if ctx.graph is None else ctx.graph.for_window(key.window)
                compact = None  # the scratch's table: page i is the table's i-th page
                if key.kernel == "compact-prefill":
                    n = table.kv_indices.numel()
                    compact = torch.arange(n, dtype=torch.int32, device=device)
                wrapper = plan_wrapper(
                    self._wrappers, self._float_ws, key, table, host, graph, compact
                )
            self._planned_gen[key] = gen
            plans[key] = ctx.plans[(id(self), key)] = GroupPlan(key, wrapper, gen)
        for (name, kv_dtype), key in layers.items():  # attend's lookup: one dict access
            ctx.plans[(id(self), name, kv_dtype)] = plans[key]
        for window in dict.fromkeys(k.window for k in plans if k.kernel in ("xqa", "triton")):
            graph = None if ctx.graph is None else ctx.graph.for_window(window)
            tables = xqa.block_tables(md.for_window(window), graph, self._xqa_graph_tables, window)
            ctx.plans[(id(self), "xqa_tables", window)] = tables
            if self._xqa_ws is None and self.fp8_decode == "xqa":  # semaphores start at zero
                self._xqa_ws = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)

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
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, QH, D], kv_cache [pages, 2, page, KH, D] -> [T, QH, D] (see module docstring).
        ``kv_scale`` [pages, 2, KH, page] fp32: the scales of a per-(token, head) cache of codes
        (``k_scale`` / ``v_scale`` then 1.0); None for every other cache. A float32 cache of a
        quantized layer (the unfused form's dequantized pages) is cast to the model dtype on the
        batch's pages first: FlashInfer reads no fp32 cache."""
        support.check_kv_scale(spec, kv_cache, kv_scale, k_scale, v_scale)
        if spec.is_quantized and kv_cache.dtype == torch.float32 != spec.model_dtype:
            kv_cache = batch_pages_as(kv_cache, ctx.metadata_for(spec).kv_indices, spec.model_dtype)
        plan = ctx.plans.get((id(self), spec.name, kv_cache.dtype))
        if plan is None:
            if kv_cache.dtype not in (spec.storage_dtype, spec.model_dtype):
                raise ValueError(
                    f"layer {spec.name!r}: cache dtype {kv_cache.dtype}, expected "
                    f"{spec.storage_dtype} (its storage) or {spec.model_dtype} (dequantized, unfused)"
                )
            hint = (
                " (the unfused form of a quantized layer needs "
                "FlashInferKernel(unfused_attention=True))"
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
        if key.kernel == "triton":  # q [B, QH, D] over XQA's dense block table; imports Triton
            from torch_kvq.attention.triton import decode_tma as tma

            t = ctx.plans[(id(self), "xqa_tables", spec.sliding_window)]
            if spec.mode.transform_coded:  # q in k's dual basis; the side rows read in place
                from torch_kvq.attention.triton.decode_tc4_tma import paged_decode_tc4_tma

                return paged_decode_tc4_tma(
                    q, kv_cache, kv_scale, t.block_tables, t.seq_lens, spec.sm_scale,
                    window=spec.sliding_window, max_seq_len=t.max_seq_len,
                )  # fmt: skip
            return tma.paged_decode_tma(
                q, kv_cache, t.block_tables, t.seq_lens, k_scale, v_scale, spec.sm_scale,
                max_seq_len=t.max_seq_len, window=spec.sliding_window,
                soft_cap=spec.logits_soft_cap or None, dot_dtype=key.q_dtype, kv_scale=kv_scale,
            )  # fmt: skip
        out = torch.empty(q.shape, dtype=key.o_dtype, device=q.device)
        if key.kernel == "compact-prefill":  # the batch's pages, dequantized, in table order
            ids = ctx.metadata_for(spec).kv_indices
            if spec.mode.transform_coded:  # k in its basis (q is in its dual), v un-rotated
                scratch = dequantize_pages_tc(kv_cache, kv_scale, ids, key.kv_dtype)
            else:
                scratch = dequantize_pages(kv_cache, kv_scale, ids, key.kv_dtype)
            return plan.wrapper.run(q, scratch, out=out)
        if kv_cache.dtype != FP8_DTYPE:
            return plan.wrapper.run(q, kv_cache, out=out)
        if key.q_dtype == FP8_DTYPE:  # fa3's FP8 kernel: quantize the query per tensor
            q8, q_scale = quantize_query(q, k_scale * spec.sm_scale)
            return plan.wrapper.run(
                q8, kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out
            )
        q = q.to(key.q_dtype)  # fp16 math (fp8_decode_math), else a no-op
        return plan.wrapper.run(q, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out)
