"""K channel scaling of 4-bit layers: the math of ``spec_channels.KChannelScale``, apply and calibrate.

A 4-bit layer's per-(token, head) codes spend their range on the channels of k with the largest
values, whether or not q weighs them. Dividing k by a scale s per (kv head, channel) before the
write and multiplying q by the same s leaves every score q . k unchanged, while the quantization
error, about isotropic after the mode's rotation, now weighs each channel by s. The error of a
score then goes as (sum_c q_c^2 s_c^2)(sum_c k_c^2 / s_c^2), least at s_c^2 = rms(k_c) / rms(q_c)
(SmoothQuant's balance at alpha 0.5). Subtracting k's mean (centring) also shrinks the range; it
shifts every score of a query by q . mean, which the softmax ignores.

The layer applies it as two pointwise ops before its flow (``scale_qk``), which ``torch.compile``
fuses into the ops that made q and k (RoPE); the kernels are the mode's own.
"""

from __future__ import annotations

import torch


def scale_qk(
    q: torch.Tensor, k: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q * s, (k - mean) / s) in fp32, returned in q's and k's dtypes. q [T, H, D], k [T, KH, D],
    scale and mean [KH, D] float32; query head h takes the row of kv head h // (H / KH)."""
    group = q.shape[1] // scale.shape[0]
    qs = (q.float() * scale.repeat_interleave(group, 0)).to(q.dtype)
    kf = k.float() if mean is None else k.float() - mean
    return qs, (kf / scale).to(k.dtype)


class ChannelStats:
    """Running sums over calibration tokens of one layer: k per channel, k^2 and q^2 (q over each
    kv head's query group), all post-RoPE (what the ``Attention`` layer receives)."""

    def __init__(self) -> None:
        self.k_sum: torch.Tensor | float = 0.0
        self.k_sq: torch.Tensor | float = 0.0
        self.q_sq: torch.Tensor | float = 0.0
        self.tokens = 0
        self.group = 0

    def add(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Add q [T, H, D] and k [T, KH, D] (summed in float64)."""
        t, kh, d = k.shape
        qd, kd = q.detach().double().cpu(), k.detach().double().cpu()
        self.k_sum = self.k_sum + kd.sum(0)
        self.k_sq = self.k_sq + kd.square().sum(0)
        self.q_sq = self.q_sq + qd.reshape(t, kh, -1, d).square().sum((0, 2))
        self.tokens += t
        self.group = q.shape[1] // kh

    def scale_and_mean(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, mean) [KH, D] float32: s_c = sqrt(rms(k_c) / rms(q_c)), scaled to a geometric mean
        of 1 per kv head; a channel whose k or q was exactly 0 on every token takes s = 1 (no
        balance to strike; a clamp there would make s depend on the clamp)."""
        if not self.tokens:
            raise ValueError("no calibration tokens were seen")
        rms_k = (self.k_sq / self.tokens).sqrt()
        rms_q = (self.q_sq / (self.tokens * self.group)).sqrt()
        live = (rms_k > 0) & (rms_q > 0)
        s = torch.where(live, rms_k / torch.where(live, rms_q, 1.0), 1.0).sqrt()
        s = s / s.log().mean(-1, keepdim=True).exp()
        return s.float(), (self.k_sum / self.tokens).float()


__all__ = ["ChannelStats", "scale_qk"]
