"""A batch's pages of a per-(token, head) cache dequantized into a compact model-dtype scratch in
one pass (the prefill path of ``kernels/flashinfer.py``): ``kv_dequant_pages_kernel``.

Each program reads one block of rows (token, kv head) of k or of v of one page, its codes and
scales, and writes the rows in the model dtype: int8 / e4m3 ``code * scale``; int4
(``int4_per_token_head``) unpacked, ``(code - zp) * scale`` and un-rotated by the Walsh-Hadamard
butterfly (``triton/hadamard.py``), so the scratch is in the model's basis, as FlashInfer's prefill
reads it. Every step is the fp32 operation ``quant.dequantize_pages_per_token_head`` performs, in
the same order, so the scratch equals the aten one bit for bit. ``k8v4_per_token_head`` (three
slots) takes two launches: k as int8 codes from slots 0 and 1, v as int4 from slot 2. The host side is
``attention/kernels/kv_dequant.py``. Imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_kvq.attention.triton.hadamard import walsh_hadamard
from torch_kvq.attention.triton.helpers import store_rounded, v_offsets


@triton.jit
def kv_dequant_pages_kernel(
    cache_ptr, scale_ptr, ids_ptr, out_ptr, signs_ptr, inv_sqrt_b,
    PAGE: tl.constexpr, KH: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr,
    ROWS: tl.constexpr, INT4: tl.constexpr, SLOTS: tl.constexpr, KV0: tl.constexpr,
    SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Rows ``[ROWS * program_id(2), ..)`` (row r: token r // KH, head r % KH) of k or v
    (``program_id(1) + KV0``) of scratch page ``program_id(0)``, which is cache page
    ``ids[pid0]``. cache [P, SLOTS, PAGE, KH, D / 2 or D] and scale [P, 2, KH, PAGE] contiguous;
    out [n, 2, PAGE, KH, D] contiguous. ``INT4``: uint8 codes two per byte, the zero point in each
    scale's low bits, ``signs_ptr`` [D] fp32 and ``inv_sqrt_b`` the rotation's sign vector and
    fp32(D ** -0.5). ``SLOTS`` 3 (``k8v4_per_token_head``): k's int8 codes as offset-binary
    bytes in slots 0 and 1 (``SPLIT_K``: channel d in slot d // (D / 2) at d % (D / 2);
    ``quant.k8v4_k_slots``), v's int4 codes in slot 2. A uint8 cache's v codes sit at their own
    positions (``helpers.v_offsets``)."""
    i = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1) + KV0
    r = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    ok = r < PAGE * KH
    page = tl.load(ids_ptr + i).to(tl.int64)
    slot = page * SLOTS + kv * (SLOTS - 1)  # k: slot 0 (and 1); v: slot 1, or 2 of 3
    t = r // KH
    h = r - t * KH
    stored = tl.load(scale_ptr + (page * 2 + kv) * (KH * PAGE) + h * PAGE + t, mask=ok, other=1.0)
    if INT4:  # channels first [D, ROWS]: the butterfly's layout (triton/hadamard.py)
        C: tl.constexpr = D // 2
        c = tl.arange(0, C)
        # v: token t's codes at their positions (``v_offsets``), k a token a row
        tok, col = v_offsets(t, c, kv == 1, PAGE, KH * C, 1, C)
        src = cache_ptr + slot * (PAGE * KH * C) + (tok + h * C)[None, :] + col[:, None]
        codes = tl.load(src, mask=ok[None, :])
        bits = stored.to(tl.int32, bitcast=True)
        scale = (bits & ~0xF).to(tl.float32, bitcast=True)
        zp = (bits & 0xF).to(tl.float32)
        lo = (codes & 0xF).to(tl.float32)
        hi = (codes >> 4).to(tl.float32)
        # channel 2j from the low nibble of byte j, 2j + 1 from the high one
        q = tl.reshape(tl.permute(tl.join(lo, hi), [0, 2, 1]), [D, ROWS])
        y = (q - zp[None, :]) * scale[None, :]
        y = walsh_hadamard(y, D, ROWS, LOG2D) * inv_sqrt_b
        y = y * tl.load(signs_ptr + tl.arange(0, D))[:, None]
        dst = out_ptr + (i * 2 + kv) * (PAGE * KH * D) + r[None, :] * D + tl.arange(0, D)[:, None]
        mask = ok[None, :]
    else:
        d = tl.arange(0, D)
        if SPLIT_K:  # k8v4's k: offset-binary bytes, channel d in slot d // (D / 2) at d % (D / 2)
            H: tl.constexpr = D // 2
            cols = d % H + d // H * (PAGE * KH * H)
            src = cache_ptr + slot * (PAGE * KH * H) + r[:, None] * H + cols[None, :]
            codes = (tl.load(src, mask=ok[:, None]) ^ 0x80).to(tl.int8, bitcast=True)
        else:
            src = cache_ptr + slot * (PAGE * KH * D) + r[:, None] * D + d[None, :]
            codes = tl.load(src, mask=ok[:, None])
        y = codes.to(tl.float32) * stored[:, None]
        dst = out_ptr + (i * 2 + kv) * (PAGE * KH * D) + r[:, None] * D + d[None, :]
        mask = ok[:, None]
    store_rounded(dst, y, mask)
