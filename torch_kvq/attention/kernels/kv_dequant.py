"""A batch's pages of a per-(token, head) cache dequantized into a compact scratch of the model
dtype, the cache FlashInfer's prefill reads for such a layer (``kernels/flashinfer.py``).

``dequantize_pages``: on a CUDA cache one Triton pass (``attention/triton/kv_dequant.py``: codes
and scales in, model-dtype rows out, int4 un-rotated on the way; a ``k8v4_per_token_head``
cache, 3 slots, in two launches: k's int8 codes, v's int4 ones); elsewhere the aten form,
``quant.dequantize_pages_per_token_head``, which the Triton pass equals bit for bit.

``batch_pages_as``: a batch's pages of a cache cast to another dtype (the unfused form's fp32
pages to the model dtype FlashInfer reads), the others left unset.
"""

from __future__ import annotations

import torch

from torch_kvq.attention.kernels.launch import next_pow2, triton_program
from torch_kvq.attention.quant import dequantize_pages_per_token_head
from torch_kvq.attention.rotation import hadamard_block, signs_on

ROW_ELEMENTS = 4096  # values of one program (rows of a page's k or v times the head size)


def dequantize_pages(
    kv_cache: torch.Tensor, kv_scale: torch.Tensor, page_ids: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``quant.dequantize_pages_per_token_head(kv_cache, kv_scale, page_ids, out_dtype)``: pages
    ``page_ids`` [n] into a compact [n, 2, page, KH, D] tensor of ``out_dtype``; one Triton pass
    on a CUDA cache (contiguous cache and scales, power-of-two head size: else ValueError)."""
    if not kv_cache.is_cuda:
        return dequantize_pages_per_token_head(kv_cache, kv_scale, page_ids, out_dtype)
    return dequantize_pages_triton(kv_cache, kv_scale, page_ids, out_dtype)


def dequantize_pages_triton(
    kv_cache: torch.Tensor, kv_scale: torch.Tensor, page_ids: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``dequantize_pages`` as one Triton program per block of rows (any device Triton runs on)."""
    pages, slots, page, kh, dc = kv_cache.shape
    int4 = kv_cache.dtype == torch.uint8  # int4, or k8v4 (3 slots: k int8, v int4)
    k8v4 = int4 and slots == 3
    d = dc * 2 if int4 else dc
    fn = "dequantize_pages"
    if (
        slots != (3 if k8v4 else 2)
        or tuple(kv_scale.shape) != (pages, 2, kh, page)
        or kv_scale.dtype != torch.float32
    ):
        raise ValueError(
            f"{fn}: kv_cache {tuple(kv_cache.shape)} / kv_scale {kv_scale.dtype} "
            f"{tuple(kv_scale.shape)}: need [P, 2, page, KH, D'] codes (k8v4: uint8 [P, 3, page, "
            "KH, D / 2]) and float32 [P, 2, KH, page]"
        )
    if not (kv_cache.is_contiguous() and kv_scale.is_contiguous()) or d & (d - 1):
        raise ValueError(
            f"{fn}: the Triton pass needs a contiguous cache and scales and a power-of-two head "
            f"size, got head size {d}, contiguous {kv_cache.is_contiguous()} / "
            f"{kv_scale.is_contiguous()}"
        )
    ids = page_ids.to(torch.int32)
    out = torch.empty((ids.numel(), 2, page, kh, d), dtype=out_dtype, device=kv_cache.device)
    if ids.numel() == 0:
        return out
    rows = max(1, min(next_pow2(page * kh), ROW_ELEMENTS // d))
    signs = signs_on(d, kv_cache.device) if int4 else kv_scale  # unused unless int4
    kernel = triton_program(
        "kv_dequant", "kv_dequant_pages_kernel", "the CUDA scratch dequantization"
    )
    blocks = -(-(page * kh) // rows)
    # k8v4: k (int8 codes over slots 0 / 1) and v (int4, slot 2) in a launch each
    for kv0, sides, is_int4 in ((0, 1, False), (1, 1, True)) if k8v4 else ((0, 2, int4),):
        kernel[(ids.numel(), sides, blocks)](
            kv_cache, kv_scale, ids, out, signs, float(hadamard_block(d) ** -0.5),
            PAGE=page, KH=kh, D=d, LOG2D=d.bit_length() - 1, ROWS=rows, INT4=is_int4,
            SLOTS=slots, KV0=kv0, SPLIT_K=k8v4 and not is_int4, num_warps=4,
        )  # fmt: skip
    return out


def batch_pages_as(
    kv_cache: torch.Tensor, page_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """A cache of ``dtype`` whose pages ``page_ids`` are ``kv_cache``'s cast to it; the others are
    left unset (the batch never reads them), so the cost follows the batch, not the pool."""
    out = torch.empty(kv_cache.shape, dtype=dtype, device=kv_cache.device)
    ids = page_ids.long()
    return out.index_copy_(0, ids, kv_cache.index_select(0, ids).to(dtype))
