"""The ``kvq::*`` custom ops, each with a fake implementation.

Unfused (eager, the reference semantics) for an FP8 layer::

    kq = kvq.quantize_fp8(k, k_scale); vq = kvq.quantize_fp8(v, v_scale)
    kvq.cache_write(kq, vq, kv_cache, layer)                   # mutates kv_cache
    kv = kvq.dequantize_kv_cache(kv_cache, k_scale, v_scale, float32, layer)  # batch's pages
    out = kvq.paged_attention(q, kv, layer)

Fused (what the passes produce)::

    kvq.quant_cache_write(k, v, kv_cache, k_scale, v_scale, layer)
    out = kvq.paged_attention_fp8(q, kv_cache, k_scale, v_scale, layer, output_scale)

Where the model's static quant divides by a *tensor* scale (a 0-d or 1-element float32 buffer or
parameter, a graph input, as vLLM's ``layer._k_scale`` / the o_proj input scale), the fused ops
take that tensor and read it on the device at run time (no ``.item()``, no host sync), so changing
the buffer in place changes what a compiled graph computes::

    kvq.quant_cache_write_ts(k, v, kv_cache, k_scale_t, v_scale_t, layer)
    out = kvq.paged_attention_fp8(q, kv_cache, k_scale, v_scale, layer, output_scale_tensor=s_t)

A skipped layer is ``cache_write`` + ``paged_attention`` on its model-dtype cache. Ops look up
the batch and kernel in the forward context by layer name; every output shape is static.

Every op that returns a tensor returns a new contiguous one (``_new_output``), whatever the
strides of its inputs: q / k / v are often views (Hugging Face attention hands over a transposed
[B, H, S, D] tensor). Each fake returns exactly what its real implementation returns (shape, dtype
and strides), so Inductor's stride assertions and ``torch.library.opcheck`` hold for any layout.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torch_kvq.attention import quant
from torch_kvq.attention.context import get_forward_context
from torch_kvq.attention.kernels.kv_write import write_kv
from torch_kvq.attention.metadata import BatchMetadata
from torch_kvq.spec import LayerKVSpec, check_scale
from torch_kvq.spec_modes import FP8_DTYPE, KVQuantMode


def _new_output(like: Tensor, dtype: torch.dtype) -> Tensor:
    """A new contiguous tensor of ``like``'s shape on its device: every tensor-returning op's
    output, allocated alike by the real implementations and the fakes."""
    return torch.empty(like.shape, dtype=dtype, device=like.device)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_kv_args(
    spec: LayerKVSpec, k: Tensor, v: Tensor, kv_cache: Tensor, dtype: torch.dtype, n: int
) -> None:
    # codes (the cache dtype) are ``code_dim`` wide: D / 2 for int4_per_token_head;
    # k8v4_per_token_head's k codes are int8 [n, KH, D], its v codes uint8 [n, KH, D / 2]
    codes = dtype == spec.storage_dtype
    width = spec.code_dim if codes else spec.head_size
    for nm, t in (("k", k), ("v", v)):
        want_dtype = dtype
        want = (n, spec.num_kv_heads, width)
        if codes and nm == "k" and spec.mode is KVQuantMode.K8V4_PER_TOKEN_HEAD:
            want_dtype, want = torch.int8, (n, spec.num_kv_heads, spec.head_size)
        _check(
            tuple(t.shape) == want,
            f"layer {spec.name!r}: {nm} has shape {tuple(t.shape)}, expected {want}",
        )
        _check(
            t.dtype == want_dtype,
            f"layer {spec.name!r}: {nm} has dtype {t.dtype}, expected {want_dtype}",
        )
    _check_cache(spec, kv_cache)


def _check_cache(spec: LayerKVSpec, kv_cache: Tensor) -> None:
    # codes are ``code_dim`` wide (int4, k8v4: D / 2) in ``cache_slots`` slots (k8v4: 3); a
    # dequantized or model-dtype cache D wide in 2
    codes = kv_cache.dtype == spec.storage_dtype
    width = spec.code_dim if codes else spec.head_size
    want = (spec.mode.cache_slots if codes else 2, spec.page_size, spec.num_kv_heads, width)
    _check(
        kv_cache.dim() == 5 and tuple(kv_cache.shape[1:]) == want,
        f"layer {spec.name!r}: kv_cache has shape {tuple(kv_cache.shape)}, expected (pages, *{want})",
    )


def _check_capacity(spec: LayerKVSpec, kv_cache: Tensor, md: BatchMetadata) -> None:
    _check(
        md.max_page_id < kv_cache.shape[0],
        f"layer {spec.name!r}: the batch uses KV page {md.max_page_id} but the layer's cache has "
        f"{kv_cache.shape[0]} pages; size the PageAllocator to the layers' num_pages",
    )


def _check_q(spec: LayerKVSpec, q: Tensor, n: int) -> None:
    want = (n, spec.num_heads, spec.head_size)
    _check(
        tuple(q.shape) == want,
        f"layer {spec.name!r}: q has shape {tuple(q.shape)}, expected {want}",
    )
    _check(
        q.dtype == spec.model_dtype,
        f"layer {spec.name!r}: q has dtype {q.dtype}, expected {spec.model_dtype}",
    )


def _check_fp8_layer(spec: LayerKVSpec, op: str) -> None:
    _check(
        spec.is_quantized,
        f"layer {spec.name!r} is not quantized (mode {spec.mode.value}); {op} refused",
    )


def _check_fp8_cache(
    spec: LayerKVSpec, kv_cache: Tensor, md: BatchMetadata, k_scale: float, v_scale: float
) -> None:
    """What the fused FP8 ops share: an FP8 cache big enough for the batch, valid k/v scales."""
    _check(
        kv_cache.dtype == FP8_DTYPE,
        f"layer {spec.name!r}: cache dtype {kv_cache.dtype}, expected float8_e4m3fn",
    )
    _check_capacity(spec, kv_cache, md)
    check_scale(k_scale, f"layer {spec.name!r}: k_scale")
    check_scale(v_scale, f"layer {spec.name!r}: v_scale")


@torch.library.custom_op("kvq::quantize_fp8", mutates_args=())
def quantize_fp8(x: Tensor, scale: float) -> Tensor:
    """Static per-tensor FP8 (e4m3) quantization; x any shape -> same shape, float8_e4m3fn."""
    check_scale(scale, "quantize_fp8 scale")
    return quant.quantize_fp8(x, scale, out=_new_output(x, FP8_DTYPE))


@quantize_fp8.register_fake
def _(x: Tensor, scale: float) -> Tensor:
    return _new_output(x, FP8_DTYPE)


@torch.library.custom_op("kvq::dequantize_kv_cache", mutates_args=())
def dequantize_kv_cache(
    kv_cache: Tensor, k_scale: float, v_scale: float, out_dtype: torch.dtype, layer_name: str
) -> Tensor:
    """The unfused form's read of an FP8 cache [pages, 2, page, KH, D]: the pages the batch in the
    forward context reads (the layer's page table) dequantized as ``code.float() * scale`` into a
    new tensor of the cache's shape in ``out_dtype`` (float32 in ``Attention``: the values the fused
    kernels read). Pages outside the batch are left unset; attention never reads them. So the cost
    follows the batch's pages, not the pool."""
    _check(
        kv_cache.dtype == FP8_DTYPE,
        f"dequantize_kv_cache expects a float8_e4m3fn cache, got {kv_cache.dtype}",
    )
    check_scale(k_scale, "dequantize_kv_cache k_scale")
    check_scale(v_scale, "dequantize_kv_cache v_scale")
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    _check_fp8_layer(spec, "dequantize_kv_cache")
    _check_cache(spec, kv_cache)
    md = ctx.metadata_for(spec)
    _check_capacity(spec, kv_cache, md)
    out = _new_output(kv_cache, out_dtype)
    pages = md.kv_indices.long()
    out[pages] = quant.dequantize_fp8_kv_cache(kv_cache[pages], k_scale, v_scale).to(out_dtype)
    return out


@dequantize_kv_cache.register_fake
def _(
    kv_cache: Tensor, k_scale: float, v_scale: float, out_dtype: torch.dtype, layer_name: str
) -> Tensor:
    return _new_output(kv_cache, out_dtype)


@torch.library.custom_op("kvq::cache_write", mutates_args=("kv_cache",))
def cache_write(k: Tensor, v: Tensor, kv_cache: Tensor, layer_name: str) -> None:
    """Write this batch's k/v [T, KH, D] (already in the cache dtype) into the paged cache."""
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    _check_kv_args(spec, k, v, kv_cache, spec.storage_dtype, ctx.metadata.num_tokens)
    md = ctx.metadata_for(spec)
    _check_capacity(spec, kv_cache, md)
    write_kv(kv_cache, k, v, md.slot_mapping)


@cache_write.register_fake
def _(k: Tensor, v: Tensor, kv_cache: Tensor, layer_name: str) -> None:
    return None


@torch.library.custom_op("kvq::quant_cache_write", mutates_args=("kv_cache",))
def quant_cache_write(
    k: Tensor, v: Tensor, kv_cache: Tensor, k_scale: float, v_scale: float, layer_name: str
) -> None:
    """Fused: quantize model-dtype k/v [T, KH, D] with static scales and write the FP8 cache (one
    Triton kernel on CUDA: ``kernels/kv_write.py``)."""
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    _check_fp8_layer(spec, "quant_cache_write")
    _check_kv_args(spec, k, v, kv_cache, spec.model_dtype, ctx.metadata.num_tokens)
    md = ctx.metadata_for(spec)
    _check_fp8_cache(spec, kv_cache, md, k_scale, v_scale)
    write_kv(kv_cache, k, v, md.slot_mapping, (k_scale, v_scale))


@quant_cache_write.register_fake
def _(
    k: Tensor, v: Tensor, kv_cache: Tensor, k_scale: float, v_scale: float, layer_name: str
) -> None:
    return None


def _check_scale_tensor(spec: LayerKVSpec, what: str, t: Tensor, like: Tensor) -> None:
    """A run-time scale tensor: float32, one element, on ``like``'s device or (0-d, which aten takes
    as a scalar) on the CPU. Its value is not checked (reading it would sync the device); the
    unfused form does not check it either."""
    _check(
        t.dtype == torch.float32 and t.numel() == 1,
        f"layer {spec.name!r}: {what} must be a float32 tensor of one element, got "
        f"{t.dtype} of shape {tuple(t.shape)}",
    )
    _check(
        t.device == like.device or (t.device.type == "cpu" and t.dim() == 0),
        f"layer {spec.name!r}: {what} is a tensor of shape {tuple(t.shape)} on {t.device}; "
        f"expected one on {like.device}, or a 0-d one on the CPU",
    )


@torch.library.custom_op("kvq::quant_cache_write_ts", mutates_args=("kv_cache",))
def quant_cache_write_ts(
    k: Tensor, v: Tensor, kv_cache: Tensor, k_scale: Tensor, v_scale: Tensor, layer_name: str
) -> None:
    """``quant_cache_write`` with the static scales as tensors read at run time: the same bytes as
    ``(k.float() / k_scale).clamp(-448, 448).to(float8_e4m3fn)`` (likewise v) written unfused."""
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    _check_fp8_layer(spec, "quant_cache_write_ts")
    _check_kv_args(spec, k, v, kv_cache, spec.model_dtype, ctx.metadata.num_tokens)
    _check(
        kv_cache.dtype == FP8_DTYPE,
        f"layer {spec.name!r}: cache dtype {kv_cache.dtype}, expected float8_e4m3fn",
    )
    md = ctx.metadata_for(spec)
    _check_capacity(spec, kv_cache, md)
    _check_scale_tensor(spec, "k_scale", k_scale, kv_cache)
    _check_scale_tensor(spec, "v_scale", v_scale, kv_cache)
    write_kv(kv_cache, k, v, md.slot_mapping, (k_scale, v_scale))


@quant_cache_write_ts.register_fake
def _(
    k: Tensor, v: Tensor, kv_cache: Tensor, k_scale: Tensor, v_scale: Tensor, layer_name: str
) -> None:
    return None


@torch.library.custom_op("kvq::paged_attention", mutates_args=())
def paged_attention(q: Tensor, kv_cache: Tensor, layer_name: str) -> Tensor:
    """Attention over a model-dtype paged cache, or over a quantized layer's dequantized (float32)
    one: the unfused form. q [T, QH, D] -> [T, QH, D] in q's dtype."""
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    _check_q(spec, q, ctx.metadata.num_tokens)
    _check_cache(spec, kv_cache)
    dequantized = spec.is_quantized and kv_cache.dtype == torch.float32
    _check(
        kv_cache.dtype == q.dtype or dequantized,
        f"layer {layer_name!r}: paged_attention needs a {q.dtype} cache"
        + (" (or its dequantized float32 one)" if spec.is_quantized else "")
        + f", got {kv_cache.dtype}",
    )
    _check_capacity(spec, kv_cache, ctx.metadata_for(spec))
    return ctx.kernel(layer_name).attend(ctx, spec, q, kv_cache, 1.0, 1.0, None)


@paged_attention.register_fake
def _(q: Tensor, kv_cache: Tensor, layer_name: str) -> Tensor:
    return _new_output(q, q.dtype)


@torch.library.custom_op("kvq::paged_attention_fp8", mutates_args=())
def paged_attention_fp8(
    q: Tensor,
    kv_cache: Tensor,
    k_scale: float,
    v_scale: float,
    layer_name: str,
    output_scale: float | None = None,
    output_scale_tensor: Tensor | None = None,
) -> Tensor:
    """Fused: attention reading the FP8 paged cache in place with k/v scales.

    q [T, QH, D] model dtype -> [T, QH, D] in q's dtype, or float8_e4m3fn (``out / output_scale``)
    when ``output_scale`` (a float) or ``output_scale_tensor`` (a 0-d / 1-element float32 tensor,
    read on the device at run time) is given; at most one of the two.
    """
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    _check_fp8_layer(spec, "paged_attention_fp8")
    _check_q(spec, q, ctx.metadata.num_tokens)
    _check_cache(spec, kv_cache)
    _check_fp8_cache(spec, kv_cache, ctx.metadata_for(spec), k_scale, v_scale)
    scale: float | Tensor | None = output_scale
    if output_scale is not None:
        check_scale(output_scale, f"layer {layer_name!r}: output_scale")
    if output_scale_tensor is not None:
        _check(
            output_scale is None,
            f"layer {layer_name!r}: paged_attention_fp8 got both output_scale and "
            "output_scale_tensor; give at most one",
        )
        _check_scale_tensor(spec, "output_scale_tensor", output_scale_tensor, q)
        scale = output_scale_tensor
    return ctx.kernel(layer_name).attend(ctx, spec, q, kv_cache, k_scale, v_scale, scale)


@paged_attention_fp8.register_fake
def _(
    q: Tensor,
    kv_cache: Tensor,
    k_scale: float,
    v_scale: float,
    layer_name: str,
    output_scale: float | None = None,
    output_scale_tensor: Tensor | None = None,
) -> Tensor:
    fp8 = output_scale is not None or output_scale_tensor is not None
    return _new_output(q, FP8_DTYPE if fp8 else q.dtype)
