"""The ``kvq::*`` custom ops of the per-(token, head) modes (``INT8_PER_TOKEN_HEAD`` /
``FP8_PER_TOKEN_HEAD`` / ``INT4_PER_TOKEN_HEAD`` / ``K8V4_PER_TOKEN_HEAD``), each traceable under
torch.compile. Math: ``attention/quant.py``.

A layer's codes live in ``kv_cache`` [pages, 2, page, KH, D] (int8 / float8_e4m3fn) and its
scales in ``kv_scale`` [pages, 2, KH, page] float32. ``mode`` is the format, ``"int8"`` or
``"fp8"`` (``KVQuantMode.per_token_head_format``). Unfused (eager, the reference semantics)::

    kc, ks = kvq.quantize_per_token_head(k, mode); vc, vs = kvq.quantize_per_token_head(v, mode)
    kvq.cache_write_per_token_head(kc, vc, ks, vs, kv_cache, kv_scale, layer)  # mutates both
    kv = kvq.dequantize_kv_cache_per_token_head(kv_cache, kv_scale, layer, float32)
    out = kvq.paged_attention(q, kv, layer)

(``k8v4_per_token_head``: k quantized with ``mode`` "int8", v with "int4"; the cache is uint8
[pages, 3, page, KH, D / 2], the dequantized one [pages, 2, page, KH, D] as for every mode.)

Fused (what the passes produce)::

    kvq.quant_cache_write_per_token_head(k, v, kv_cache, kv_scale, layer, rounding)
    out = kvq.paged_attention_per_token_head(q, kv_cache, kv_scale, layer)

The unfused dequantize reads only the batch's pages (the layer's page table in the forward
context: ``ctx.metadata_for(spec).kv_indices``) into a new tensor of the cache's full shape;
other pages are left unset and never read, so eager cost follows the tokens the batch reads, not
the pool. ``rounding`` ("half_away", the quantize op's int8 rounding, or "half_even", what
``torch.round`` does when a model wrote the torch-native form) makes the fused write
bit-identical to whichever form it replaced.

The two writes (``cache_write_per_token_head``, ``quant_cache_write_per_token_head``) register no
fake: they return nothing and declare what they mutate, so torch generates theirs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torch_kvq.attention import quant
from torch_kvq.attention.context import get_forward_context
from torch_kvq.attention.kernels.kv_write_per_token_head import (
    put_per_token_head,
    write_kv_per_token_head,
)
from torch_kvq.attention.metadata import BatchMetadata
from torch_kvq.attention.ops import (
    _check,
    _check_cache,
    _check_capacity,
    _check_kv_args,
    _check_q,
    _new_output,
)
from torch_kvq.spec import LayerKVSpec


def _check_pth_layer(spec: LayerKVSpec, op: str) -> str:
    """The layer's format ("int8" / "fp8" / "int4" / "k8v4"); ValueError unless its mode is
    per-(token, head)."""
    _check(
        spec.mode.per_token_head,
        f"layer {spec.name!r} has mode {spec.mode.value}, not a per-(token, head) mode; {op} "
        "refused",
    )
    return spec.mode.per_token_head_format


def _check_pth_cache(
    spec: LayerKVSpec, kv_cache: Tensor, kv_scale: Tensor, md: BatchMetadata
) -> None:
    """Codes of the layer's dtype and shape, scales float32 [pages, 2, KH, page], room for the
    batch."""
    _check(
        kv_cache.dtype == spec.storage_dtype,
        f"layer {spec.name!r}: cache dtype {kv_cache.dtype}, expected {spec.storage_dtype} "
        f"(mode {spec.mode.value})",
    )
    _check_cache(spec, kv_cache)  # [pages, 2, page, KH, D] (int4: D / 2; k8v4: 3 slots of D / 2)
    want = (kv_cache.shape[0], 2, spec.num_kv_heads, spec.page_size)
    _check(
        kv_scale.dtype == torch.float32 and tuple(kv_scale.shape) == want,
        f"layer {spec.name!r}: kv_scale is {kv_scale.dtype} {tuple(kv_scale.shape)}, expected "
        f"float32 {want} (pages, k / v, kv heads, page)",
    )
    _check_capacity(spec, kv_cache, md)


@torch.library.custom_op("kvq::quantize_per_token_head", mutates_args=())
def quantize_per_token_head(x: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (codes [..., D] int8 / float8_e4m3fn, scales [...] float32): one scale per
    head vector, int8 rounded half away from zero (``quant.quantize_per_token_head``)."""
    codes, scales = quant.quantize_per_token_head(x, mode)
    out_codes = _new_output(codes, codes.dtype)
    out_scales = _new_output(scales, torch.float32)
    return out_codes.copy_(codes), out_scales.copy_(scales)


@quantize_per_token_head.register_fake
def _(x: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    code_dtype, _ = quant.per_token_head_format(mode)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if mode == "int4":  # two codes per byte
        codes = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=code_dtype, device=x.device)
        return codes, scales
    return _new_output(x, code_dtype), scales


@torch.library.custom_op("kvq::cache_write_per_token_head", mutates_args=("kv_cache", "kv_scale"))
def cache_write_per_token_head(
    k_codes: Tensor,
    v_codes: Tensor,
    k_scales: Tensor,
    v_scales: Tensor,
    kv_cache: Tensor,
    kv_scale: Tensor,
    layer_name: str,
) -> None:
    """Write this batch's codes [T, KH, D] into ``kv_cache`` and their scales [T, KH] into
    ``kv_scale`` at the batch's slots (k8v4: k's int8 codes [T, KH, D], v's packed [T, KH, D / 2])."""
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    _check_pth_layer(spec, "cache_write_per_token_head")
    n = ctx.metadata.num_tokens
    _check_kv_args(spec, k_codes, v_codes, kv_cache, spec.storage_dtype, n)
    md = ctx.metadata_for(spec)
    _check_pth_cache(spec, kv_cache, kv_scale, md)
    for nm, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        _check(
            s.dtype == torch.float32 and tuple(s.shape) == (n, spec.num_kv_heads),
            f"layer {spec.name!r}: {nm} is {s.dtype} {tuple(s.shape)}, expected float32 "
            f"{(n, spec.num_kv_heads)}",
        )
    put_per_token_head(kv_cache, kv_scale, k_codes, v_codes, k_scales, v_scales, md.slot_mapping)


@torch.library.custom_op("kvq::dequantize_kv_cache_per_token_head", mutates_args=())
def dequantize_kv_cache_per_token_head(
    kv_cache: Tensor, kv_scale: Tensor, layer_name: str, out_dtype: torch.dtype
) -> Tensor:
    """The unfused form's read: the batch's pages dequantized as ``code.float() * scale`` into a
    new tensor of the cache's shape in ``out_dtype`` (float32 in ``Attention``); other pages unset
    (module docstring)."""
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    _check_pth_layer(spec, "dequantize_kv_cache_per_token_head")
    md = ctx.metadata_for(spec)
    _check_pth_cache(spec, kv_cache, kv_scale, md)
    out = _dequantized_output(kv_cache, out_dtype)
    pages = md.kv_indices.long()
    out[pages] = quant.dequantize_pages_per_token_head(kv_cache, kv_scale, pages, out_dtype)
    return out


@dequantize_kv_cache_per_token_head.register_fake
def _(kv_cache: Tensor, kv_scale: Tensor, layer_name: str, out_dtype: torch.dtype) -> Tensor:
    return _dequantized_output(kv_cache, out_dtype)


def _dequantized_output(kv_cache: Tensor, out_dtype: torch.dtype) -> Tensor:
    """A new [pages, 2, page, KH, D] tensor of ``out_dtype``: the cache's shape, its last dim
    doubled for a uint8 (``int4_per_token_head``: two codes per byte; ``k8v4_per_token_head``:
    3 slots of D / 2) cache, its dim 1 k and v."""
    pages, _, page, kh, dc = kv_cache.shape
    d = dc * (2 if kv_cache.dtype == torch.uint8 else 1)
    return torch.empty((pages, 2, page, kh, d), dtype=out_dtype, device=kv_cache.device)


@torch.library.custom_op(
    "kvq::quant_cache_write_per_token_head", mutates_args=("kv_cache", "kv_scale")
)
def quant_cache_write_per_token_head(
    k: Tensor, v: Tensor, kv_cache: Tensor, kv_scale: Tensor, layer_name: str, rounding: str
) -> None:
    """Fused: quantize model-dtype k/v [T, KH, D] per (token, kv head) and write codes and scales
    (``kernels/kv_write_per_token_head.write_kv_per_token_head``), the bytes the unfused form
    writes."""
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    fmt = _check_pth_layer(spec, "quant_cache_write_per_token_head")
    _check_kv_args(spec, k, v, kv_cache, spec.model_dtype, ctx.metadata.num_tokens)
    md = ctx.metadata_for(spec)
    _check_pth_cache(spec, kv_cache, kv_scale, md)
    write_kv_per_token_head(kv_cache, kv_scale, k, v, md.slot_mapping, fmt, rounding)  # type: ignore[arg-type]


@torch.library.custom_op("kvq::paged_attention_per_token_head", mutates_args=())
def paged_attention_per_token_head(
    q: Tensor, kv_cache: Tensor, kv_scale: Tensor, layer_name: str
) -> Tensor:
    """Fused: attention reading the codes and scales in place. q [T, QH, D] model dtype ->
    [T, QH, D] in q's dtype."""
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    _check_pth_layer(spec, "paged_attention_per_token_head")
    _check_q(spec, q, ctx.metadata.num_tokens)
    _check_pth_cache(spec, kv_cache, kv_scale, ctx.metadata_for(spec))
    return ctx.kernel(layer_name).attend(ctx, spec, q, kv_cache, 1.0, 1.0, None, kv_scale)


@paged_attention_per_token_head.register_fake
def _(q: Tensor, kv_cache: Tensor, kv_scale: Tensor, layer_name: str) -> Tensor:
    return _new_output(q, q.dtype)
