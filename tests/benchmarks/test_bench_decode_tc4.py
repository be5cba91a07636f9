"""``bench_decode_tc4.py``'s synthetic tc4 cache (CPU): its side rows hold the fp16 scales and zero
points it means (``quant_tc``'s layout), so the timed decode reads finite values."""

from __future__ import annotations

import torch
from bench_decode_tc4 import tc4_cache

from torch_kvq.attention import quant_tc


def test_synthetic_cache_has_valid_scales_and_zero_points() -> None:
    codes, aux = tc4_cache(3, 16, 2, 128, device="cpu")
    rows = quant_tc.aux_from_cache(aux)  # [pages, page, KH, record bytes]
    k_side, v_side = quant_tc.split_aux(rows)
    scales = torch.cat((k_side[..., :6], v_side[..., :4]), -1).contiguous().view(torch.float16)
    assert scales.shape[-1] == 5 and ((scales >= 0.0099) & (scales <= 0.1)).all()
    assert k_side[..., 6:9].tolist()[0][0][0] == [32, 8, 4] and (v_side[..., 4:6] == torch.tensor(
        [16, 8], dtype=torch.uint8)).all()  # fmt: skip
    kv = quant_tc.dequantize_pages(codes, aux)
    assert torch.isfinite(kv).all() and kv.abs().max() < 10
