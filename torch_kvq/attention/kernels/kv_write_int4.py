"""The ``int4_per_token_head`` cache write's Triton launch (host side of
``attention/triton/kv_write.py``'s ``kv_write_int4_kernel``).

``kernels/kv_write_per_token_head.write_kv_per_token_head`` sends an int4 write on a CUDA cache
here (after its argument checks, and after checking that aten's tensor division on the device is
correctly rounded: ``-lo / scale`` of the zero point is one). The program writes the bytes of
``quant.quantize_int4_rotated`` (the aten form, ``write_kv_per_token_head_torch``) computed on
the same device: the rotation (signs, Walsh-Hadamard butterfly, times ``fp32(b ** -0.5)``) in
registers, then per clip ratio of ``quant.INT4_CLIP_RATIOS`` the same fp32 operations one by one
(launched with ``enable_fp_fusion=False``: no product and sum fused into an fma, which aten's
separate ops never do), the reciprocal of the scale and the zero point's quotient correctly
rounded (``div_rn``; ``require_correct_reciprocal`` checks that ``torch.reciprocal`` is on the
device), each row's squared errors summed in fp64 and the first least kept. The fp64 sums may
add in another order than aten's; two ratios whose errors differ by less than such a rounding
(far below any real difference: each term is exact in fp64) could be picked differently.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from torch_kvq.attention.kernels.base import KernelUnsupportedError
from torch_kvq.attention.kernels.launch import f32, next_pow2
from torch_kvq.attention.quant import INT4_CLIP_RATIOS, INT4_LEVELS, SCALE_FLOOR
from torch_kvq.attention.rotation import hadamard_block, signs_on
from torch_kvq.attention.triton.decode_config import sm_count

# (token, kv head) rows of k (and of v) per program: one a thread (the program holds its rows
# channels first, so each thread's row stays in its registers: rotation, min / max and error sums
# without shuffles, and the per-row scale math once per row)
INT4_WARPS = 1
INT4_ROWS = 32 * INT4_WARPS
# fewer rows than this per SM: one row per program, its channels across the lanes
# (``ROWS_FIRST``), so that a decode step's few tokens spread over the SMs
INT4_ROWS_FIRST_BELOW = 32


def rows_first_warps(block_d: int) -> int:
    """Warps of a ``ROWS_FIRST`` program (one row, its clip ratios side by side: ``_int4_row``):
    one for rows of up to 128 channels, two above, as timed fastest on an H200
    (``benchmarks/sweep_kv_write_launch.py --int4``; numbers in docs/performance.md)."""
    return 1 if block_d <= 128 else 2


@functools.cache
def clip_ratios(device: torch.device) -> torch.Tensor:
    """``INT4_CLIP_RATIOS`` as fp32 on ``device`` (the fp32 values aten multiplies by)."""
    return torch.tensor(INT4_CLIP_RATIOS, dtype=torch.float32, device=device)


@functools.cache
def require_correct_reciprocal(device: torch.device) -> None:
    """KernelUnsupportedError unless ``torch.reciprocal`` of fp32 on ``device`` is correctly
    rounded (the program's ``div_rn(1, scale)``), checked on probe values once per device (not
    inside CUDA graph capture: the probe reads its result on the host)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise KernelUnsupportedError(
            f"the int4 cache write's reciprocal probe for {device} cannot run inside CUDA graph "
            "capture; run one uncaptured step first (DecodeGraphRunner's warm-up runs do)"
        )
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([torch.tensor([3.0, 0.03, 1e-6, 7.7e-3, 123.456]),
                   torch.rand(4096, generator=gen).mul(30).sub(20).exp2()])  # fmt: skip
    want = (1.0 / x.double()).float()  # fp32 quotients round correctly through float64
    got = torch.reciprocal(x.to(device)).cpu()
    if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
        raise KernelUnsupportedError(
            f"torch.reciprocal on {device} (torch {torch.__version__}) is not correctly rounded; "
            "the int4 cache write's Triton program divides correctly rounded and would not "
            "write the same bytes"
        )


def launch_int4_write(
    program: Any,
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    v_only: bool = False,
) -> Any:
    """``kv_write_int4_kernel`` (``program``) over the T * KH (token, kv head) rows of k and v
    [T, KH, D] (any strides), into codes ``kv_cache`` [pages, 2, page, KH, D / 2] uint8 and
    scales ``kv_scale`` [pages, 2, KH, page] fp32 at ``slot_mapping`` [T] slots. ``v_only``
    (``k8v4_per_token_head``: ``kv_cache`` [pages, 3, page, KH, D / 2], v's codes in slot 2): v
    alone, as the program's side 0 (its k side) over the views ``kv_cache[:, 2:]`` and
    ``kv_scale[:, 1:]``, so the same bytes land in v's slots. Arguments already checked
    (``check_per_token_head_write``). Returns the launched program's handle (its ``asm`` on a
    GPU), None for an empty batch."""
    t, kh, d = k.shape
    if t == 0:
        return None
    sides = 2
    if v_only:
        k, kv_cache, kv_scale, sides = v, kv_cache[:, 2:], kv_scale[:, 1:], 1
    require_correct_reciprocal(kv_cache.device)
    b = hadamard_block(d)
    block_d = next_pow2(d)
    n_rows = t * kh
    sms = sm_count(kv_cache.device)
    rows_first = n_rows < INT4_ROWS_FIRST_BELOW * sms
    block_r = 1 if rows_first else INT4_ROWS  # a power of two
    return program[(-(-n_rows // block_r), sides)](
        k, v, kv_cache, kv_scale, slot_mapping, signs_on(d, kv_cache.device),
        clip_ratios(kv_cache.device), n_rows,
        *k.stride(), *v.stride(), *kv_cache.stride(), *kv_scale.stride(), kv_cache.shape[2],
        KH=kh, D=d, BLOCK_R=block_r, BLOCK_D=block_d, LOG2B=b.bit_length() - 1,
        RSQRT_B=f32(b**-0.5), RCP15=f32(1.0 / INT4_LEVELS), FLOOR=f32(SCALE_FLOOR),
        NUM_RATIOS=len(INT4_CLIP_RATIOS), ROWS_FIRST=rows_first, V_SIDE=0 if v_only else 1,
        RATIOS_PAD=next_pow2(len(INT4_CLIP_RATIOS)),
        num_warps=rows_first_warps(block_d) if rows_first else INT4_WARPS,
        enable_fp_fusion=False,
    )  # fmt: skip
