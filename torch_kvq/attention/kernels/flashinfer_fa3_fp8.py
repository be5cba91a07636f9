"""fa3's FP8 prefill (``FlashInferKernel(prefill="fa3_fp8")``): the query quantized per tensor.

FlashInfer 0.6.18's fa3 FP8 mainloop masks the raw code logits q8.k8 with a finite -5e4 and
scales afterwards (its issue #4267, fixed after 0.6.18). At small query scales a masked key then
sits close to the real logits, and the error follows the masked key's real logit
(docs/design/fa3_fp8_mask_analysis.md). ``quantize_query`` floors the query scale so a masked key is
>= ``FA3_FP8_MASK_MARGIN`` below in real logit units. Imports nothing from FlashInfer.
"""

from __future__ import annotations

import torch

from torch_kvq.spec_modes import FP8_DTYPE

FA3_FP8_SENTINEL = 5e4  # FlashInfer 0.6.18 math::inf, the FP8 mainloop's mask value in code units
FA3_FP8_MASK_MARGIN = 100.0  # how far below (in real logit units) a masked key must sit


def quantize_query(q: torch.Tensor, k_logit_scale: float) -> tuple[torch.Tensor, float]:
    """q [T, QH, D] -> (e4m3 q / scale, scale) per tensor, for fa3's FP8 prefill kernel.

    scale = max(amax(|q|) / 448, FA3_FP8_MASK_MARGIN / (FA3_FP8_SENTINEL * k_logit_scale)) with
    ``k_logit_scale`` = k_scale * sm_scale: that kernel masks the raw code logits q8.k8 with the
    finite -5e4, which in real logit units is -5e4 * scale * k_logit_scale; the floor keeps it at
    least FA3_FP8_MASK_MARGIN below zero (a larger scale only shrinks the codes; e4m3's relative
    precision holds down to codes of 2**-6). Read on the host: fa3 takes q_scale as a float
    (prefill only, never in a CUDA graph). The cast saturates at +-448."""
    if not k_logit_scale > 0:
        raise ValueError(f"quantize_query: k_scale * sm_scale must be > 0, got {k_logit_scale!r}")
    amax = float(q.abs().amax())
    scale = max(amax / 448.0, FA3_FP8_MASK_MARGIN / (FA3_FP8_SENTINEL * k_logit_scale))
    return (q * (1.0 / scale)).to(FP8_DTYPE), scale
