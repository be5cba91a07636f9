"""A batch's pages of a ``tc4_per_token_head`` cache dequantized into a compact scratch of the
model dtype, the cache FlashInfer's prefill reads for such a layer (``kernels/flashinfer.py``):
on a CUDA cache one Triton pass (``attention/triton/kv_dequant_tc.py``), elsewhere the aten form
``quant_tc.dequantize_pages``, which the pass equals bit for bit. k stays in its basis."""

from __future__ import annotations

import torch

from torch_kvq.attention import quant_tc
from torch_kvq.attention.kernels.launch import next_pow2, triton_program
from torch_kvq.attention.rotation import hadamard_block, signs_on

ROW_ELEMENTS = 4096  # values of one program (rows of a page's k or v times the head size)
HEAD_SIZES = (64, 128, 256)  # the pass's tiles are powers of two


def dequantize_pages_tc(
    kv_cache: torch.Tensor, kv_aux: torch.Tensor, page_ids: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Pages ``page_ids`` [n] of a tc4 cache (``quant_tc``'s layout) into a compact [n, 2, page,
    KH, D] tensor of ``out_dtype``: ``quant_tc.dequantize_pages(...).to(out_dtype)``."""
    if not kv_cache.is_cuda:
        ids = page_ids.long()
        return quant_tc.dequantize_pages(kv_cache[ids], kv_aux[ids]).to(out_dtype)
    return dequantize_pages_tc_triton(kv_cache, kv_aux, page_ids, out_dtype)


def dequantize_pages_tc_triton(
    kv_cache: torch.Tensor, kv_aux: torch.Tensor, page_ids: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``dequantize_pages_tc`` as one Triton program per block of rows (any device Triton runs
    on). ValueError for a cache or aux of another shape, dtype or layout, or a head size the pass
    does not take."""
    pages, slots, page, kh, half = kv_cache.shape
    d = 2 * half
    aux = quant_tc.aux_width(d)
    if (
        slots != 2
        or d not in HEAD_SIZES
        or tuple(kv_aux.shape) != (pages, kh, aux, page)
        or kv_cache.dtype != torch.uint8
        or kv_aux.dtype != torch.uint8
        or not (kv_cache.is_contiguous() and kv_aux.is_contiguous())
    ):
        raise ValueError(
            f"dequantize_pages_tc: kv_cache {kv_cache.dtype} {tuple(kv_cache.shape)} / kv_aux "
            f"{kv_aux.dtype} {tuple(kv_aux.shape)}: need contiguous uint8 [P, 2, page, KH, D / 2] "
            f"and [P, KH, {aux}, page] with head size D in {HEAD_SIZES}"
        )
    ids = page_ids.to(torch.int32)
    out = torch.empty((ids.numel(), 2, page, kh, d), dtype=out_dtype, device=kv_cache.device)
    if ids.numel() == 0:
        return out
    rows = max(1, min(next_pow2(page * kh), ROW_ELEMENTS // d))
    kernel = triton_program(
        "kv_dequant_tc", "kv_dequant_tc_kernel", "the tc4 scratch dequantization"
    )
    kernel[(ids.numel(), 2, -(-(page * kh) // rows))](
        kv_cache, kv_aux, ids, out, signs_on(d // 2, kv_cache.device),
        float(hadamard_block(d // 2) ** -0.5), PAGE=page, KH=kh, D=d, ROWS=rows, AUX=aux,
        LOG2C=(d // 2).bit_length() - 1, num_warps=4,
    )  # fmt: skip
    return out
