"""A batch's pages of a ``tc4_per_token_head`` cache dequantized into a compact model-dtype scratch
in one pass (the prefill path of ``kernels/flashinfer.py``): ``kv_dequant_tc_kernel``, host side
``attention/kernels/kv_dequant_tc.py``.

Each program reads one block of rows (token, kv head) of k or of v of one page: k's 16-bit lanes
(``quant_tc.pack_k_lanes``) to its three groups' codes, ``(code - zp) * scale`` per group (k stays
in its basis: q is in the dual one); v's bytes from their ``v_layout`` positions, half 1's fifth
bits from the aux rows, ``(code - zp) * scale`` per half and each half un-rotated by the
Walsh-Hadamard butterfly over D / 2 channels (``triton/hadamard.py``). Every step is the fp32
operation ``quant_tc.dequantize_pages`` performs, in the same order, so the scratch equals the
aten one bit for bit. Imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_kvq.attention.triton.hadamard import walsh_hadamard
from torch_kvq.attention.triton.helpers import store_rounded, v_offsets
from torch_kvq.attention.triton.tc4_aux import (
    KS,
    KZ,
    VH,
    VS,
    VZ,
    aux_byte,
    aux_slot,
    fifth_bit_at,
)


@triton.jit
def _slot(block, t, ok, PAGE: tl.constexpr, SLOT: tl.constexpr):
    """fp16 slot SLOT of tokens t [ROWS] from their aux blocks (``block`` [ROWS]), fp32."""
    return tl.load(aux_slot(block, t, PAGE, SLOT), mask=ok, other=1.0).to(tl.float32)


@triton.jit
def _zp(block, t, ok, PAGE: tl.constexpr, BYTE: tl.constexpr):
    """Record byte BYTE (a zero point) of tokens t, fp32."""
    return tl.load(aux_byte(block, t, PAGE, BYTE), mask=ok, other=0).to(tl.float32)


@triton.jit
def _half(c, zp, scale, signs_ptr, inv_sqrt_b, C: tl.constexpr, ROWS: tl.constexpr,
          LOG2C: tl.constexpr):  # fmt: skip
    """A v half's codes [C, ROWS] (channels first) -> ``rotation.unrotate((c - zp) * scale)``."""
    y = (c.to(tl.float32) - zp[None, :]) * scale[None, :]
    y = walsh_hadamard(y, C, ROWS, LOG2C) * inv_sqrt_b
    return y * tl.load(signs_ptr + tl.arange(0, C))[:, None]


@triton.jit
def kv_dequant_tc_kernel(
    cache_ptr, aux_ptr, ids_ptr, out_ptr, signs_ptr, inv_sqrt_b,
    PAGE: tl.constexpr, KH: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
    AUX: tl.constexpr, LOG2C: tl.constexpr,
):  # fmt: skip
    """Rows ``[ROWS * program_id(2), ..)`` (row r: token r // KH, head r % KH) of k (``program_id
    (1)`` 0) or v (1) of scratch page ``program_id(0)``, which is cache page ``ids[pid0]``. cache
    uint8 [P, 2, PAGE, KH, D / 2] and aux uint8 [P, KH, AUX, PAGE] contiguous; out [n, 2, PAGE,
    KH, D] contiguous. ``signs_ptr`` [D / 2] fp32 and ``inv_sqrt_b`` v's halves' rotation."""
    i = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    r = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    ok = r < PAGE * KH
    page = tl.load(ids_ptr + i).to(tl.int64)
    t = r // KH
    h = r - t * KH
    block = aux_ptr + (page * KH + h) * (AUX * PAGE)  # [ROWS] each row's aux block
    C: tl.constexpr = D // 2
    out_row = out_ptr + (i * 2 + kv) * (PAGE * KH * D) + r * D  # [ROWS]
    if kv == 0:  # k: lanes a | b << 6 | c_even << 10 | c_odd << 13, in its basis
        Q: tl.constexpr = D // 4
        j = tl.arange(0, Q)
        lanes = cache_ptr.to(tl.pointer_type(tl.int16)) + (page * 2 * PAGE * KH + r) * Q
        x = tl.load(lanes[:, None] + j[None, :], mask=ok[:, None]).to(tl.int32) & 0xFFFF
        za = _zp(block, t, ok, PAGE, KZ)
        y = ((x & 63).to(tl.float32) - za[:, None]) * _slot(block, t, ok, PAGE, KS // 2)[:, None]
        store_rounded(out_row[:, None] + j[None, :], y, ok[:, None])
        zb = _zp(block, t, ok, PAGE, KZ + 1)
        sb = _slot(block, t, ok, PAGE, KS // 2 + 1)
        y = (((x >> 6) & 15).to(tl.float32) - zb[:, None]) * sb[:, None]
        store_rounded(out_row[:, None] + Q + j[None, :], y, ok[:, None])
        cc = tl.reshape(tl.join((x >> 10) & 7, x >> 13), [ROWS, C])  # channel 2j, 2j + 1
        zc = _zp(block, t, ok, PAGE, KZ + 2)
        y = (cc.to(tl.float32) - zc[:, None]) * _slot(block, t, ok, PAGE, KS // 2 + 2)[:, None]
        store_rounded(out_row[:, None] + C + tl.arange(0, C)[None, :], y, ok[:, None])
    else:  # v: byte j = half 1's low 4 bits | half 2's code << 4, at v_layout's positions
        U: tl.constexpr = D // 16
        c = tl.arange(0, C)
        tok, col = v_offsets(t, c, True, PAGE, KH * C, 1, C)
        src = cache_ptr + (page * 2 + 1) * (PAGE * KH * C) + (tok + h * C)[None, :] + col[:, None]
        codes = tl.load(src, mask=ok[None, :]).to(tl.int32)  # [C, ROWS], channels first
        # half 1's fifth bit of channel c: aux row AUX_V_HIGH + byte, at bit (fifth_bit_at)
        byte, bit = fifth_bit_at(c, U)
        fifth = tl.load(block[None, :] + (byte + VH)[:, None] * PAGE + t[None, :],
                        mask=ok[None, :], other=0).to(tl.int32)  # fmt: skip
        c1 = (codes & 15) | (((fifth >> bit[:, None]) & 1) << 4)
        y1 = _half(c1, _zp(block, t, ok, PAGE, VZ), _slot(block, t, ok, PAGE, VS // 2),
                   signs_ptr, inv_sqrt_b, C, ROWS, LOG2C)  # fmt: skip
        y2 = _half(codes >> 4, _zp(block, t, ok, PAGE, VZ + 1),
                   _slot(block, t, ok, PAGE, VS // 2 + 1), signs_ptr, inv_sqrt_b, C, ROWS,
                   LOG2C)  # fmt: skip
        store_rounded(out_row[None, :] + c[:, None], y1, ok[None, :])
        store_rounded(out_row[None, :] + C + c[:, None], y2, ok[None, :])
