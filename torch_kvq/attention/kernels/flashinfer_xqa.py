"""XQA decode for ``FlashInferKernel(fp8_decode="xqa")``: the dense block table it reads, and the call.

XQA (``trtllm_batch_decode_with_kv_cache(backend="xqa")``) takes a dense block table [B, W] rather
than FlashInfer's CSR page table; ``block_tables`` gathers it on the device (no host loop, no sync).
``run`` is one decode call: q [B, QH, D] model dtype over an FP8 (or model-dtype) paged NHD cache
[pages, 2, page, KH, D] -> [B, QH, D] in the model dtype, or float8_e4m3fn (``out / output_scale``).
Imports flashinfer lazily (GPU only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torch_kvq.spec import LayerKVSpec
from torch_kvq.spec_modes import FP8_DTYPE

if TYPE_CHECKING:
    from torch_kvq.attention.metadata import BatchMetadata, GraphShape


@dataclass(frozen=True)
class XQATables:
    block_tables: torch.Tensor  # [B, max_pages] int32 on the device (padding: page 0, never read)
    seq_lens: torch.Tensor  # [B] int32 on the device (XQA reads it as uint32)
    max_seq_len: int


def block_tables(
    md: BatchMetadata,
    graph: GraphShape | None,
    graph_buffers: dict[tuple[int | None, GraphShape], torch.Tensor] | None = None,
    window: int | None = None,
) -> XQATables:
    """XQA's dense block table [B, W] from the CSR page table ``md`` (``window``'s; entries past a
    sequence's pages are 0 and never read). Under a CUDA graph W is the shape's
    ``max_pages_per_seq`` and the table is written into the (window, shape)'s fixed [B, W] int32
    buffer in ``graph_buffers`` (made on first use), which the graph reads."""
    graph_buffer = None
    if graph is not None and graph_buffers is not None:
        graph_buffer = graph_buffers.get((window, graph))
        if graph_buffer is None:
            shape = (md.num_seqs, graph.max_pages_per_seq)  # the step's padded batch
            graph_buffer = torch.empty(shape, dtype=torch.int32, device=md.kv_indices.device)
            graph_buffers[(window, graph)] = graph_buffer
    width = max(md.pages_per_seq) if graph is None else graph.max_pages_per_seq
    dev = md.kv_indices.device
    cols = torch.arange(width, dtype=torch.int32, device=dev)
    starts, counts = md.kv_indptr[:-1, None], (md.kv_indptr[1:] - md.kv_indptr[:-1])[:, None]
    idx = (starts + cols).clamp_(max=md.kv_indices.numel() - 1).long()
    out = None if graph_buffer is None else graph_buffer.view(-1)
    table = torch.index_select(md.kv_indices, 0, idx.view(-1), out=out).view(idx.shape)
    table.masked_fill_(cols >= counts, 0)
    return XQATables(block_tables=table, seq_lens=md.seq_lens, max_seq_len=width * md.page_size)


def run(
    spec: LayerKVSpec,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: XQATables,
    workspace: torch.Tensor,
    k_scale: float,
    v_scale: float,
    output_scale: float | None,
    pdl: bool,
) -> torch.Tensor:
    """One XQA decode call for ``spec``'s layer (see the module docstring for shapes)."""
    from torch_kvq.attention.kernels.flashinfer_plan import import_flashinfer

    decode = import_flashinfer("flashinfer.decode").trtllm_batch_decode_with_kv_cache
    o_scale = 1.0 if output_scale is None else float(output_scale)
    out = torch.empty(
        q.shape, dtype=FP8_DTYPE if output_scale is not None else q.dtype, device=q.device
    )
    return decode(
        q, kv_cache, workspace, tables.block_tables, tables.seq_lens, tables.max_seq_len,
        bmm1_scale=k_scale * spec.sm_scale,
        bmm2_scale=v_scale / o_scale,  # FlashInfer's convention: gives out = attn / o_scale
        window_left=-1 if spec.sliding_window is None else spec.sliding_window - 1,
        out=out, kv_layout="NHD", backend="xqa", o_scale=o_scale, enable_pdl=pdl,
    )  # fmt: skip
