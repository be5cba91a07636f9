"""The reference kernel: pure torch paged attention, CPU and GPU. The oracle for every test.

GQA, causal masking, sliding window (a query at position p sees keys at p - window < pos <= p),
logit soft-cap, FP8 caches read in place with k/v scales, per-(token, head) caches (int8 / FP8
codes, or int4 ones dequantized and un-rotated back to the model's basis) read in place with their
``kv_scale``, tc4 caches with their side rows (k left in its basis, v un-rotated), optional FP8
output. Math in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torch_kvq.attention import quant_tc
from torch_kvq.attention.quant import dequantize_pages_per_token_head, quantize_fp8
from torch_kvq.spec import LayerKVSpec

if TYPE_CHECKING:
    from torch_kvq.attention.context import ForwardContext


def ref_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    sm_scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Dense attention in fp32.

    q [Tq, QH, D], k / v [L, KH, D], q_pos [Tq], k_pos [L] -> [Tq, QH, D] fp32. Grouped-query
    attention without copies: batched matmuls over the kv heads, each serving its group of query
    heads in place, so the cost follows the tokens, not ``QH / KH`` copies. The same operations as
    transformers' eager attention (scores, scale, soft-cap, mask, softmax, weighted sum), so a
    model-dtype cache in fp32 gives its logits exactly.
    """
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    tq, qh, d = q.shape
    kh = k.shape[1]
    g = qh // kh  # [KH, G * Tq, D]: query heads kh * G .. kh * G + G - 1 read kv head kh
    qg = q.float().view(tq, kh, g, d).permute(1, 2, 0, 3).reshape(kh, g * tq, d)
    logits = torch.bmm(qg, k.float().permute(1, 2, 0)).mul_(sm_scale)
    if logits_soft_cap:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    logits = logits.view(kh, g, tq, -1).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1).view(kh, g * tq, -1)
    out = torch.bmm(probs, v.float().transpose(0, 1))  # [KH, G * Tq, D]
    return out.view(kh, g, tq, d).permute(2, 0, 1, 3).reshape(tq, qh, d)


class ReferenceKernel:
    """Serves every layer on any device, every mode; supports FP8 output (with a float or a
    run-time tensor output scale: tensor math on the device, no host sync)."""

    name = "reference"
    # attend slices per sequence with host lengths: a captured graph would bake them in
    supports_cuda_graphs = False

    def check_supported(self, spec: LayerKVSpec) -> None:
        return None

    def plan(self, ctx: ForwardContext, specs: list[LayerKVSpec]) -> None:
        return None

    def attend(
        self,
        ctx: ForwardContext,
        spec: LayerKVSpec,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        k_scale: float,
        v_scale: float,
        output_scale: float | torch.Tensor | None,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        md = ctx.metadata_for(spec)
        kh, d = kv_cache.shape[3], spec.head_size  # an int4 cache's last dim is D / 2
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        q_start = page_start = 0
        for qo_len, kv_len, n_pages in zip(md.qo_lens, md.kv_lens, md.pages_per_seq):
            page_ids = md.kv_indices[page_start : page_start + n_pages].long()
            if kv_scale is None:
                ctx_kv = kv_cache[page_ids]  # [n, 2, page, KH, D]; only this sequence's pages
                k = ctx_kv[:, 0].reshape(-1, kh, d)[:kv_len].float() * k_scale
                v = ctx_kv[:, 1].reshape(-1, kh, d)[:kv_len].float() * v_scale
            else:  # the unfused dequant's fp32 values: code.float() * scale, or tc4's groups
                kv = (
                    quant_tc.dequantize_pages(kv_cache[page_ids], kv_scale[page_ids])
                    if spec.mode.transform_coded
                    else dequantize_pages_per_token_head(
                        kv_cache, kv_scale, page_ids, torch.float32
                    )
                )
                k = kv[:, 0].reshape(-1, kh, d)[:kv_len]
                v = kv[:, 1].reshape(-1, kh, d)[:kv_len]
            k_pos = torch.arange(kv_len, device=q.device)
            out[q_start : q_start + qo_len] = ref_attention(
                q[q_start : q_start + qo_len],
                k,
                v,
                k_pos[kv_len - qo_len :],
                k_pos,
                spec.sm_scale,
                spec.sliding_window,
                spec.logits_soft_cap,
            )
            q_start += qo_len
            page_start += n_pages
        if output_scale is not None:
            return quantize_fp8(out, output_scale)
        return out.to(q.dtype)
