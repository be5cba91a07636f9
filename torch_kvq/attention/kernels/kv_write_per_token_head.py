"""The per-(token, head) modes' paged cache write: ``write_kv_per_token_head`` (the dispatcher),
its argument checks, its aten form (the oracle) and its Triton launch. It lives apart from
``kv_write.py``, which holds the per-tensor write and the measurement of aten's division that both
writes follow (imported from there), so that each write has a module of its own; the int4
program's launch is ``kv_write_int4.py``.

Per-(token, head) modes (``write_kv_per_token_head``; math: ``quant.quantize_per_token_head``):
the codes go into ``kv_cache`` and one fp32 scale per (token, kv head) for k and for v into
``kv_scale`` [pages, 2, KH, page]. On a CUDA cache one Triton program per few tokens writes
both; its bytes and scales are those of the unfused torch ops on that device: ``absmax / QMAX`` (a
Python-float divisor) in aten's measured form (``aten_scalar_division``; QMAX is exact in fp32, so
the two reciprocal forms agree), ``x.float() / scale`` (a tensor divisor) correctly rounded, as
``aten_scalar_division(device, "tensor")`` must confirm, else the write is refused.
``int4_per_token_head`` (codes [pages, 2, page, KH, D / 2] uint8) is its own program, launched by
``kernels/kv_write_int4.py`` (rotation, MSE-clipped asymmetric int4, two codes per byte).
``k8v4_per_token_head`` (layer format "k8v4": k int8, v int4, codes [pages, 3, page, KH, D / 2]
uint8) takes both: the int8 program writes k's codes as bytes over slots 0 and 1, the int4 one
v's into slot 2, each bit-equal to its side of the aten form.
"""

from __future__ import annotations

import torch

from torch_kvq.attention.kernels.kv_write import (
    aten_scalar_division,
    pages_and_offsets,
    require_correct_tensor_division,
    scalar_operand,
    write_program,
)
from torch_kvq.attention.kernels.kv_write_int4 import launch_int4_write
from torch_kvq.attention.kernels.launch import f32, next_pow2
from torch_kvq.attention.quant import (
    SCALE_FLOOR,
    Rounding,
    cache_layout,
    k8v4_k_slots,
    kv_formats,
    per_token_head_format,
    quantize_per_token_head,
)
from torch_kvq.attention.triton.decode_config import sm_count
from torch_kvq.attention.v_layout import v_positions

# The per-(token, head) write's launch: values of k (and of v) per program, and its warps
WRITE_ROW_ELEMENTS = 2048
WRITE_WARPS = 2


def write_kv_per_token_head(
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    mode: str,
    rounding: Rounding = "half_away",
) -> None:
    """Quantize k/v [T, KH, D] per (token, kv head) (``mode`` "int8" | "fp8", int8 ``rounding``
    "half_away" | "half_even") and write the codes into ``kv_cache`` [pages, 2, page, KH, D] and
    the scales into ``kv_scale`` [pages, 2, KH, page] fp32 at ``slot_mapping`` [T] slots. CUDA:
    ``write_kv_per_token_head_triton``; elsewhere ``write_kv_per_token_head_torch``. ``mode="int4"``
    (``int4_per_token_head``): codes [pages, 2, page, KH, D / 2] uint8, the same way.
    ``mode="k8v4"`` (``k8v4_per_token_head``: k "int8", v "int4", codes [pages, 3, page, KH, D /
    2] uint8), the same way."""
    check_per_token_head_write(kv_cache, kv_scale, k, v, slot_mapping, mode, rounding)
    if kv_cache.is_cuda:
        write_kv_per_token_head_triton(kv_cache, kv_scale, k, v, slot_mapping, mode, rounding)
    else:
        write_kv_per_token_head_torch(kv_cache, kv_scale, k, v, slot_mapping, mode, rounding)


def check_per_token_head_write(
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    mode: str,
    rounding: str,
) -> None:
    """ValueError naming the first bad argument of ``write_kv_per_token_head``."""
    code_dtype, slots, per_element = cache_layout(mode)
    per_token_head_format(kv_formats(mode)[0], rounding)  # ValueError for a bad rounding
    fn = "write_kv_per_token_head"
    if kv_cache.dim() != 5 or kv_cache.shape[1] != slots or kv_cache.dtype != code_dtype:
        dims = "D" if per_element == 1 else "D / 2"
        raise ValueError(
            f"{fn}: kv_cache is {kv_cache.dtype} {tuple(kv_cache.shape)}; mode {mode!r} needs "
            f"{code_dtype} [pages, {slots}, page, KH, {dims}]"
        )
    pages, _, page, kh, d = kv_cache.shape
    d *= per_element  # int4 / k8v4: two codes (or half of k's int8 codes) per element
    want = (pages, 2, kh, page)
    if tuple(kv_scale.shape) != want or kv_scale.dtype != torch.float32:
        raise ValueError(
            f"{fn}: kv_scale is {kv_scale.dtype} {tuple(kv_scale.shape)}; expected float32 {want} "
            "(pages, k / v, kv heads, page)"
        )
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 3 or x.shape[1:] != (kh, d) or not x.dtype.is_floating_point:
            raise ValueError(
                f"{fn}: {name} is {x.dtype} {tuple(x.shape)}; expected a floating [T, {kh}, {d}]"
            )
    if v.shape != k.shape or slot_mapping.shape != k.shape[:1] or slot_mapping.is_floating_point():
        raise ValueError(
            f"{fn}: k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)} must agree: [T, KH, D] twice, [T] int"
        )
    devices = {str(x.device) for x in (kv_cache, kv_scale, k, v, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"{fn}: arguments on several devices {sorted(devices)}; expected one")


def write_kv_per_token_head_torch(
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    mode: str,
    rounding: Rounding = "half_away",
) -> None:
    """``write_kv_per_token_head`` in aten ops (any device): the oracle for the Triton program.
    k and v each in their format (``quant.kv_formats``: "k8v4" is k "int8", v "int4")."""
    k_fmt, v_fmt = kv_formats(mode)
    kc, ks = quantize_per_token_head(k, k_fmt, rounding)
    vc, vs = quantize_per_token_head(v, v_fmt, rounding)
    put_per_token_head(kv_cache, kv_scale, kc, vc, ks, vs, slot_mapping)


def put_per_token_head(
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    k_codes: torch.Tensor,
    v_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Put codes [T, KH, D] into ``kv_cache`` and their scales [T, KH] into ``kv_scale`` at
    ``slot_mapping`` [T] slots (no checks; ``kvq::cache_write_per_token_head`` and the aten
    write). A 3-slot cache is ``k8v4_per_token_head``'s: k's int8 codes into slots 0 and 1
    (``quant.k8v4_k_slots``), v's packed codes into slot 2. A uint8 cache's v codes go to their
    own positions (``v_layout.v_positions``)."""
    pages, offsets = pages_and_offsets(slot_mapping, kv_cache.shape[2])
    if kv_cache.shape[1] == 3:
        kv_cache[pages, :2, offsets] = k8v4_k_slots(k_codes)
    else:
        kv_cache[pages, 0, offsets] = k_codes
    v_slot, page, w = kv_cache.shape[1] - 1, kv_cache.shape[2], kv_cache.shape[-1]
    if kv_cache.dtype == torch.uint8:  # [T, KH, W] codes at [T, 1, W] rows and columns
        rows, cols = (x[:, None] for x in v_positions(offsets, w, page))
        heads = torch.arange(kv_cache.shape[3], device=offsets.device)[None, :, None]
        kv_cache[pages[:, None, None], v_slot, rows, heads, cols] = v_codes
    else:
        kv_cache[pages, v_slot, offsets] = v_codes
    kv_scale[pages, 0, :, offsets] = k_scales  # [T, KH]
    kv_scale[pages, 1, :, offsets] = v_scales


def write_kv_per_token_head_triton(
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    mode: str,
    rounding: Rounding = "half_away",
) -> None:
    """``write_kv_per_token_head`` as one Triton program per ``WRITE_ROW_ELEMENTS`` values of k
    (several tokens when heads are small; any strides, the page size a compile-time constant);
    the divisions follow aten on the cache's device (module docstring). int4:
    ``launch_int4_write``. k8v4: two launches, k by the int8 program (``SPLIT_K``: its codes'
    bytes over slots 0 and 1), v by the int4 one (``v_only``: slot 2)."""
    k_fmt, v_fmt = kv_formats(mode)
    int4_kernel = write_program("kv_write_int4_kernel") if v_fmt == "int4" else None
    kernel = None if k_fmt == "int4" else write_program("kv_write_per_token_head_kernel")
    t, kh, d = k.shape
    if t == 0:
        return
    # x / scale (int4: -lo / scale): a tensor divisor
    require_correct_tensor_division(kv_cache.device, "the per-(token, head) cache write")
    if int4_kernel is not None:  # int4: k and v; k8v4: v alone, into slot 2
        launch_int4_write(int4_kernel, kv_cache, kv_scale, k, v, slot_mapping, k_fmt != "int4")
    if kernel is None:
        return
    code_dtype, qmax = per_token_head_format(k_fmt, rounding)
    division = aten_scalar_division(kv_cache.device)  # absmax / QMAX: a Python-float divisor
    block_h, block_d = next_pow2(kh), next_pow2(d)
    # a program quantizes WRITE_ROW_ELEMENTS values of k (and of v): several tokens when heads are
    # small, one when there are too few tokens to fill the GPU that way (a decode step's batch)
    block_t = max(1, WRITE_ROW_ELEMENTS // (block_h * block_d))
    if t < block_t * sm_count(kv_cache.device):
        block_t = 1
    kernel[(-(-t // block_t),)](
        k, v, kv_cache, kv_scale, slot_mapping, scalar_operand(division, qmax), t,
        *k.stride(), *v.stride(), *kv_cache.stride(), *kv_scale.stride(),
        PAGE=kv_cache.shape[2], KH=kh, D=d, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, QMAX=qmax,
        FLOOR=f32(SCALE_FLOOR), DIVIDE=division == "div", INT8=code_dtype == torch.int8,
        HALF_AWAY=rounding == "half_away", SPLIT_K=v_fmt != k_fmt, num_warps=WRITE_WARPS,
    )  # fmt: skip
