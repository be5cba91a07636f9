"""The plan side of ``FlashInferKernel``: group keys, FlashInfer's wrappers and their ``plan()``.

Layers whose ``GroupKey`` is equal (everything a FlashInfer plan bakes in: kernel, backend,
window, kv / q / output dtypes, soft-cap, sm_scale, heads, head size) share one plan per batch.
``plan_wrapper`` builds a wrapper once per (key, CUDA-graph shape) and plans it on a batch's page
table, from host copies of the table's indptrs (``HostIndptrs``: built from the metadata's host
lists, so planning never syncs the device). Under a CUDA graph the decode wrapper owns fixed
page-table buffers that every plan for that shape refills in place.

``import_flashinfer`` is the one lazy import of FlashInfer (an optional extra; GPU only).
"""

from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from torch_kvq.attention.kernels.base import KernelUnsupportedError

if TYPE_CHECKING:
    from torch_kvq.attention.metadata import BatchMetadata, GraphShape


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


@dataclass(frozen=True)
class GroupKey:
    """Everything one FlashInfer plan bakes in; layers with equal keys share one plan."""

    kernel: str  # "prefill" | "compact-prefill" | "decode" | "xqa" | "triton"
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


@dataclass(frozen=True)
class HostIndptrs:
    """CPU copies of the page-table indptrs, built from the metadata's host lists (no device sync)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    last_page_len: torch.Tensor

    @classmethod
    def build(cls, md: BatchMetadata) -> HostIndptrs:
        qo = [0, *itertools.accumulate(md.qo_lens)]
        kv = [0, *itertools.accumulate(md.pages_per_seq)]
        last = [n - (p - 1) * md.page_size for n, p in zip(md.kv_lens, md.pages_per_seq)]
        i32 = dict(dtype=torch.int32)
        return cls(
            qo_indptr=torch.tensor(qo, **i32),
            kv_indptr=torch.tensor(kv, **i32),
            last_page_len=torch.tensor(last, **i32),
        )


def plan_wrapper(
    wrappers: dict[tuple[GroupKey, GraphShape | None], Any],
    float_ws: torch.Tensor,
    key: GroupKey,
    md: BatchMetadata,
    host: HostIndptrs,
    graph: GraphShape | None,
    kv_indices: torch.Tensor | None = None,
) -> Any:
    """Plan ``key``'s wrapper (built on first use into ``wrappers``, on the shared ``float_ws``)
    for the page table ``md`` (its page ids replaced by ``kv_indices`` when given: a compact
    scratch's 0..n-1); a prefill wrapper for ``key.kernel`` "prefill" / "compact-prefill", else
    the tensor-core decode wrapper (with fixed buffers when ``graph`` is given)."""
    flashinfer = import_flashinfer()
    prefill = key.kernel in ("prefill", "compact-prefill")
    indices = md.kv_indices if kv_indices is None else kv_indices
    wrapper = wrappers.get((key, graph))
    if wrapper is None:
        if prefill:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                float_ws, "NHD", backend=key.backend
            )
        elif graph is None:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                float_ws, "NHD", use_tensor_cores=True, backend="fa2"
            )
        else:  # fixed buffers, refilled by every plan for this shape
            b, dev, i32 = graph.batch_size, float_ws.device, torch.int32
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                float_ws, "NHD", use_tensor_cores=True, backend="fa2",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=i32, device=dev),
                paged_kv_indices_buffer=torch.zeros(
                    b * graph.max_pages_per_seq, dtype=i32, device=dev
                ),
                paged_kv_last_page_len_buffer=torch.zeros(b, dtype=i32, device=dev),
            )  # fmt: skip
        wrappers[(key, graph)] = wrapper
    common = dict(
        window_left=-1 if key.window is None else key.window - 1,
        logits_soft_cap=key.soft_cap,
        sm_scale=key.sm_scale,
        q_data_type=key.q_dtype,
        kv_data_type=key.kv_dtype,
        o_data_type=key.o_dtype,
    )
    if prefill:
        wrapper.plan(
            host.qo_indptr, host.kv_indptr, indices, host.last_page_len,
            key.num_heads, key.num_kv_heads, key.head_size, md.page_size,
            causal=True, **common,
        )  # fmt: skip
    else:
        wrapper.plan(
            host.kv_indptr, indices, host.last_page_len,
            key.num_heads, key.num_kv_heads, key.head_size, md.page_size, **common,
        )  # fmt: skip
    return wrapper
