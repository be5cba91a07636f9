"""The ``Attention`` layer: owns its paged KV cache and runs the readable unfused form.

The cache is a buffer, so it flows through the compiled graph as a tensor and the passes can
rewrite quantize -> write -> dequantize -> attend into the fused form.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from torch import nn

from torch_kvq.attention import ops as _ops  # noqa: F401  (registers torch.ops.kvq.*)
from torch_kvq.attention import ops_per_token_head as _ops_pth  # noqa: F401  (likewise)
from torch_kvq.attention import ops_tc as _ops_tc  # noqa: F401  (likewise)
from torch_kvq.attention import registry
from torch_kvq.attention.k_basis import basis_operand, inverse_transpose
from torch_kvq.attention.k_channels import scale_qk
from torch_kvq.attention.quant import FP8_MAX, quantize_fp8, quantize_per_token_head
from torch_kvq.spec import LayerKVSpec, check_positive_int
from torch_kvq.spec_modes import tc4_aux_width

QuantForm = Literal["op", "torch"]


class FP8RangeWarning(UserWarning):
    """k or v of an FP8 layer reached beyond what its scale can represent, so values were
    clamped to +-448 * scale."""


class Attention(nn.Module):
    """Paged attention for one layer, per its ``LayerKVSpec``.

    forward(q [T, QH, D], k [T, KH, D], v [T, KH, D]) -> [T, QH, D], for the batch in the active
    forward context. ``quant_form`` picks how k/v quantization is written for quantized layers:
    the op (``kvq.quantize_fp8`` / ``kvq.quantize_per_token_head``) or the torch-native expression
    (``quant.quantize_fp8`` / ``quant.quantize_per_token_head`` with ``torch.round``); the passes
    fuse both. A per-(token, head) layer keeps its scales in a second buffer, ``kv_scale``
    [pages, 2, KH, page] float32 (None for the other modes).

    ``int4_per_token_head``: ``kv_cache`` is uint8 [pages, 2, page, KH, D / 2] (two codes per
    byte), ``kv_scale`` holds each scale with its zero point in the low mantissa bits. The write
    rotates k and v (``rotation.rotate``) and quantizes them; the read dequantizes and un-rotates
    (``rotation.unrotate``), so attention sees k and v in the model's basis and q is not rotated.
    That equals rotating q and k (scores unchanged, the rotation is orthogonal) and un-rotating
    the output (attention is linear in v) in exact arithmetic; the fused kernels will do that
    instead, to skip the per-key un-rotation. Such a layer takes ``quant_form="op"`` only.

    ``k8v4_per_token_head``: k quantized as ``int8_per_token_head`` (``mode.k_format``), v as
    ``int4_per_token_head`` (``mode.v_format``); ``kv_cache`` is uint8 [pages, 3, page, KH, D / 2]
    (slots 0 / 1: k's int8 codes, first and second half of the channels; slot 2: v's packed
    codes), ``kv_scale`` as above (k's int8 scale, v's int4 scale with its zero point).
    ``quant_form="op"`` only, as int4.

    An int4 layer with ``spec.k_channel`` (``spec_channels.KChannelScale``) holds it in two more buffers,
    ``k_channel_scale`` and ``k_channel_mean`` [KH, D] float32 (the mean None when not centred),
    and starts its flow with ``k_channels.scale_qk``: q * s and (k - mean) / s, plain pointwise
    ops that a compiled graph fuses into the ops that made q and k.

    ``tc4_per_token_head`` (``ops_tc``): ``kv_cache`` uint8 [pages, 2, page, KH, D / 2] (k's codes
    in its basis, v's), ``kv_scale`` uint8 [pages, KH, tc4_aux_width(D), page] (each (token, kv
    head)'s group scales, zero points and v's fifth bits). The layer holds its ``spec.k_basis``
    as ``k_basis`` P and ``k_basis_inv_t`` P^-T (``k_basis.basis_operand`` of the model's dtype:
    [KH, D, D] float32, or a 16-bit model's pair [KH, D, 2D]) and starts its flow with
    ``kvq.basis_qk`` (P k, P^-T q: ``k_basis.basis_qk``'s math, one Triton launch on CUDA); the
    read gives k in that basis and v in the model's, so attention needs nothing more.
    ``quant_form="op"`` only.
    """

    def __init__(
        self,
        spec: LayerKVSpec,
        num_pages: int,
        device: torch.device | str | None = None,
        quant_form: QuantForm = "op",
    ) -> None:
        super().__init__()
        if quant_form not in ("op", "torch"):
            raise ValueError(f"quant_form {quant_form!r} unknown; expected 'op' or 'torch'")
        check_positive_int(num_pages, "num_pages")
        if quant_form == "torch" and spec.mode.codes_per_byte == 2:
            raise ValueError(
                f"layer {spec.name!r}: mode {spec.mode.value!r} has no torch-native quant form "
                "(its rotation and MSE-clipped 4-bit codes are one op, kvq.quantize_per_token_head, "
                "which the passes fuse); use quant_form='op'"
            )
        self.spec = spec
        self.layer_name = spec.name
        self.quant_form = quant_form
        self.range_reported = False  # one FP8RangeWarning per layer
        # D / 2: int4, k8v4 (whose dim 1 is 3: k's int8 codes in two halves, v's packed codes)
        shape = (num_pages, spec.mode.cache_slots, spec.page_size, spec.num_kv_heads, spec.code_dim)
        self.register_buffer(
            "kv_cache",
            torch.zeros(shape, dtype=spec.storage_dtype, device=device),
            persistent=False,
        )
        # per-(token, head) modes: one fp32 scale per (token, kv head) for k and for v, a page's
        # scales of one head contiguous; None for the other modes
        self.kv_scale: torch.Tensor | None
        scale = None
        if spec.mode.per_token_head:
            scale_shape = (num_pages, 2, spec.num_kv_heads, spec.page_size)
            scale = torch.zeros(scale_shape, dtype=torch.float32, device=device)
        elif spec.mode.transform_coded:
            aux = tc4_aux_width(spec.head_size)
            scale_shape = (num_pages, spec.num_kv_heads, aux, spec.page_size)
            scale = torch.zeros(scale_shape, dtype=torch.uint8, device=device)
        self.register_buffer("kv_scale", scale, persistent=False)
        self.k_channel_scale: torch.Tensor | None
        self.k_channel_mean: torch.Tensor | None
        ch = spec.k_channel
        for name, rows in (("scale", ch and ch.scale), ("mean", ch and ch.mean)):
            value = None if rows is None else torch.tensor(rows, dtype=torch.float32, device=device)
            self.register_buffer(f"k_channel_{name}", value, persistent=False)
        self.k_basis: torch.Tensor | None
        self.k_basis_inv_t: torch.Tensor | None
        p = None if spec.k_basis is None else spec.k_basis.matrix()
        p_inv_t = None if p is None else inverse_transpose(p)
        for name, value in (("k_basis", p), ("k_basis_inv_t", p_inv_t)):
            if value is not None:  # as basis_qk takes it in the model's dtype
                value = basis_operand(value, spec.model_dtype).to(device)
            self.register_buffer(name, value, persistent=False)
        registry.register(self)

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"{s.name!r}, mode={s.mode.value}, cache={tuple(self.kv_cache.shape)} {s.storage_dtype}"
            + ("" if self.kv_scale is None else f", kv_scale={tuple(self.kv_scale.shape)}")
            + ("" if s.k_channel is None else f", k_channel={s.k_channel.label}")
            + ("" if s.k_basis is None else f", k_basis={s.k_basis.label}")
        )

    def _quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if self.quant_form == "op":
            return torch.ops.kvq.quantize_fp8(x, scale)
        return quantize_fp8(x, scale)  # the torch-native expression, traced

    def _quantize_per_token_head(
        self, x: torch.Tensor, fmt: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.quant_form == "op":
            return torch.ops.kvq.quantize_per_token_head(x, fmt)
        return quantize_per_token_head(x, fmt, "half_even")  # the torch-native form (.round())

    def _check_range(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Warn (once per layer) when k or v exceeds +-448 * its scale: those values are clamped.
        Eager only: a compiled graph does not read k / v a second time to check (and a CUDA graph
        capture cannot sync); ``kvq calibrate`` reports the same from its statistics."""
        if torch.compiler.is_compiling() or self.range_reported:
            return
        if k.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        spec = self.spec
        for which, x, scale in (("k", k, spec.k_scale), ("v", v, spec.v_scale)):
            amax = x.detach().abs().amax().item() if x.numel() else 0.0
            if amax > FP8_MAX * scale:
                self.range_reported = True
                warnings.warn(
                    f"layer {spec.name!r}: |{which}| reaches {amax:.4g}, beyond the FP8 range of "
                    f"its {which}_scale {scale:.4g} (+-{FP8_MAX * scale:.4g}); those values are "
                    "clamped. Give calibrated scales (kv_scales=, kv_scales_from=, kvq calibrate)",
                    FP8RangeWarning,
                    stacklevel=2,
                )
                return

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if self.k_channel_scale is not None:
            q, k = scale_qk(q, k, self.k_channel_scale, self.k_channel_mean)
        if spec.mode.transform_coded:  # its K basis: resolve refuses a tc4 layer without one
            q, k = torch.ops.kvq.basis_qk(q, k, self.k_basis, self.k_basis_inv_t)
            kc, ka = torch.ops.kvq.quantize_tc(k, "k")
            vc, va = torch.ops.kvq.quantize_tc(v, "v")
            torch.ops.kvq.cache_write_tc(kc, vc, ka, va, self.kv_cache, self.kv_scale, spec.name)
            kv = torch.ops.kvq.dequantize_kv_cache_tc(
                self.kv_cache, self.kv_scale, spec.name, torch.float32
            )
            return torch.ops.kvq.paged_attention(q, kv, spec.name)
        if spec.mode.per_token_head:
            kc, ks = self._quantize_per_token_head(k, spec.mode.k_format)
            vc, vs = self._quantize_per_token_head(v, spec.mode.v_format)
            torch.ops.kvq.cache_write_per_token_head(
                kc, vc, ks, vs, self.kv_cache, self.kv_scale, spec.name
            )
            kv = torch.ops.kvq.dequantize_kv_cache_per_token_head(
                self.kv_cache, self.kv_scale, spec.name, torch.float32
            )
            return torch.ops.kvq.paged_attention(q, kv, spec.name)
        if spec.is_quantized:
            self._check_range(k, v)
            kq = self._quantize(k, spec.k_scale)
            vq = self._quantize(v, spec.v_scale)
            torch.ops.kvq.cache_write(kq, vq, self.kv_cache, spec.name)
            # fp32: the dequantized values the fused kernels read, never rounded to the model dtype
            kv = torch.ops.kvq.dequantize_kv_cache(
                self.kv_cache, spec.k_scale, spec.v_scale, torch.float32, spec.name
            )
            return torch.ops.kvq.paged_attention(q, kv, spec.name)
        torch.ops.kvq.cache_write(k, v, self.kv_cache, spec.name)
        return torch.ops.kvq.paged_attention(q, self.kv_cache, spec.name)
