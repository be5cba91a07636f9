"""The ``tc4_per_token_head`` cache write: aten (``quant_tc``'s math, any device) and its Triton
program on CUDA (``attention/triton/kv_write_tc.py``), which writes the same bytes.

``write_kv_tc`` is what ``kvq.quant_cache_write_tc`` runs: on a CUDA cache the Triton program
(one launch for every row of k and v; head sizes 64, 128 and 256, whose groups are powers of
two), else the aten form. The program takes ``quant_tc``'s steps one fp32 operation at a time
(launched with ``enable_fp_fusion=False``), the reciprocal and the zero point's quotient correctly
rounded (``kv_write_int4.require_correct_reciprocal`` checks aten's on the device), the errors in
fp64 (their sums may add in another order than aten's: two clip ratios whose errors differ by
less than such a rounding could be picked differently, as for the int4 write).
"""

from __future__ import annotations

import torch

from torch_kvq.attention import quant_tc
from torch_kvq.attention.kernels.base import KernelUnsupportedError
from torch_kvq.attention.kernels.kv_write import pages_and_offsets
from torch_kvq.attention.kernels.kv_write_int4 import (
    clip_ratios,
    require_correct_reciprocal,
)
from torch_kvq.attention.kernels.launch import f32, next_pow2, triton_program
from torch_kvq.attention.quant import INT4_CLIP_RATIOS, SCALE_FLOOR
from torch_kvq.attention.rotation import hadamard_block, signs_on
from torch_kvq.attention.v_layout import v_positions

TRITON_HEAD_SIZES = (64, 128, 256)  # the program's groups are tl.arange tiles: powers of two


def write_kv_tc(
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Quantize k (in its basis) and v [T, KH, D] and write code rows into ``kv_cache`` [pages,
    2, page, KH, D / 2] and side rows into ``kv_scale`` [pages, KH, aux, page] at
    ``slot_mapping`` [T] slots (arguments checked by the caller). CUDA: the Triton program
    (``KernelUnsupportedError`` for a head size it does not take); elsewhere aten."""
    if kv_cache.is_cuda:
        write_kv_tc_triton(kv_cache, kv_scale, k, v, slot_mapping)
    else:
        write_kv_tc_torch(kv_cache, kv_scale, k, v, slot_mapping)


def write_kv_tc_torch(
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The aten form: ``quant_tc.quantize_k`` / ``quantize_v``, then the rows put at the slots."""
    kc, ka = quant_tc.quantize_k(k)
    vc, va = quant_tc.quantize_v(v)
    put_tc(kv_cache, kv_scale, kc, vc, ka, va, slot_mapping)


def put_tc(
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_aux: torch.Tensor,
    v_aux: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Put code rows [T, KH, D / 2] and side parts into the caches at ``slot_mapping`` [T]: v's
    bytes at their own positions (``v_layout.v_positions``), the aux records' at theirs
    (``quant_tc.aux_positions``)."""
    page, w = kv_cache.shape[2], kv_cache.shape[-1]
    pages, offsets = pages_and_offsets(slot_mapping, page)
    kv_cache[pages, 0, offsets] = k_codes
    heads = torch.arange(kv_cache.shape[3], device=offsets.device)[None, :, None]
    rows, cols = (x[:, None] for x in v_positions(offsets, w, page))
    kv_cache[pages[:, None, None], 1, rows, heads, cols] = v_codes
    records = quant_tc.join_aux(k_aux, v_aux)  # [T, KH, width]
    rows, cols = (x[:, None] for x in quant_tc.aux_positions(offsets, records.shape[-1], page))
    kv_scale[pages[:, None, None], heads, rows, cols] = records


def write_kv_tc_triton(
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``kv_write_tc_kernel`` over the T * KH rows of k and of v (any strides for k, v and the
    cache; ``kv_scale``'s aux blocks contiguous: ValueError)."""
    t, kh, d = k.shape
    page = kv_cache.shape[2]
    if kv_scale.stride()[-2:] != (page, 1):
        raise ValueError(
            f"the tc4 cache write's Triton program needs each page's aux block contiguous "
            f"(strides [..., {page}, 1]), got kv_scale strides {kv_scale.stride()}"
        )
    if d not in TRITON_HEAD_SIZES:
        raise KernelUnsupportedError(
            f"the tc4 cache write's Triton program takes head sizes {TRITON_HEAD_SIZES}, got {d}"
        )
    if t == 0:
        return
    require_correct_reciprocal(kv_cache.device)
    program = triton_program("kv_write_tc", "kv_write_tc_kernel", "the tc4 cache write")
    b = hadamard_block(d // 2)
    program[(t * kh, 2)](
        k, v, kv_cache, kv_scale, slot_mapping, signs_on(d // 2, kv_cache.device),
        clip_ratios(kv_cache.device), *k.stride(), *v.stride(), *kv_cache.stride(),
        kv_scale.stride(0), kv_scale.stride(1), page,
        KH=kh, D=d, LOG2B=b.bit_length() - 1, RSQRT_B=f32(b**-0.5), FLOOR=f32(SCALE_FLOOR),
        HALF_MIN=quant_tc.HALF_SCALE_MIN, NUM_RATIOS=len(INT4_CLIP_RATIOS),
        RATIOS_PAD=next_pow2(len(INT4_CLIP_RATIOS)), RCP63=f32(1 / 63), RCP31=f32(1 / 31),
        RCP15=f32(1 / 15), RCP7=f32(1 / 7), num_warps=1 if d <= 128 else 2,
        enable_fp_fusion=False,
    )  # fmt: skip
