"""The ``kvq::*`` custom ops of ``TC4_PER_TOKEN_HEAD`` (transform-coded), each traceable under
torch.compile. Math and layout: ``attention/quant_tc.py``; the K basis: ``attention/k_basis.py``.

A layer's codes live in ``kv_cache`` uint8 [pages, 2, page, KH, D / 2] (slot 0: k's codes in its
basis, slot 1: v's) and each (token, kv head)'s group scales, zero points and v's fifth bits in
``kv_scale`` uint8 [pages, KH, tc4_aux_width(D), page]. The layer's flow (reference semantics)::

    q, k = kvq.basis_qk(q, k, P, P^-T)                      # before the flow
    kc, ka = kvq.quantize_tc(k, "k"); vc, va = kvq.quantize_tc(v, "v")
    kvq.cache_write_tc(kc, vc, ka, va, kv_cache, kv_scale, layer)   # mutates both
    kv = kvq.dequantize_kv_cache_tc(kv_cache, kv_scale, layer, float32)  # k in P's basis
    out = kvq.paged_attention(q, kv, layer)

Fused (what the passes produce; the write is kernel-independent, the attention the layer's
kernel's, which reads the codes and side rows in place)::

    kvq.quant_cache_write_tc(k, v, kv_cache, kv_scale, layer)
    out = kvq.paged_attention_tc(q, kv_cache, kv_scale, layer)

The read fills only the batch's pages (the layer's page table in the forward context), as the
per-(token, head) modes' does. The writes register no fake: they return nothing and declare what
they mutate.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torch_kvq.attention import quant_tc
from torch_kvq.attention.context import get_forward_context
from torch_kvq.attention.kernels.basis_qk import apply_basis
from torch_kvq.attention.kernels.kv_write_tc import put_tc, write_kv_tc
from torch_kvq.attention.metadata import BatchMetadata
from torch_kvq.attention.ops import _check, _check_cache, _check_capacity, _check_q, _new_output
from torch_kvq.spec import LayerKVSpec
from torch_kvq.spec_modes import tc4_aux_width

SIDES = ("k", "v")


def _check_tc_layer(spec: LayerKVSpec, op: str) -> None:
    _check(
        spec.mode.transform_coded,
        f"layer {spec.name!r} has mode {spec.mode.value}, not tc4_per_token_head; {op} refused",
    )


def _check_tc_cache(
    spec: LayerKVSpec, kv_cache: Tensor, kv_scale: Tensor, md: BatchMetadata
) -> None:
    """Codes uint8 [pages, 2, page, KH, D / 2], side rows uint8 [pages, KH, aux, page], room for
    the batch."""
    _check(
        kv_cache.dtype == torch.uint8,
        f"layer {spec.name!r}: cache dtype {kv_cache.dtype}, expected torch.uint8 (mode "
        f"{spec.mode.value})",
    )
    _check_cache(spec, kv_cache)
    want = (kv_cache.shape[0], spec.num_kv_heads, tc4_aux_width(spec.head_size), spec.page_size)
    _check(
        kv_scale.dtype == torch.uint8 and tuple(kv_scale.shape) == want,
        f"layer {spec.name!r}: kv_scale is {kv_scale.dtype} {tuple(kv_scale.shape)}, expected "
        f"uint8 {want} (pages, kv heads, side row bytes, page)",
    )
    _check_capacity(spec, kv_cache, md)


def _side(side: str) -> str:
    _check(side in SIDES, f"side {side!r} unknown; expected 'k' or 'v'")
    return side


@torch.library.custom_op("kvq::basis_qk", mutates_args=())
def basis_qk(q: Tensor, k: Tensor, p: Tensor, p_inv_t: Tensor) -> tuple[Tensor, Tensor]:
    """(P^-T q, P k): the layer's K basis on q [T, H, D] and k [T, KH, D], P and P^-T as
    ``k_basis.basis_operand`` made them (``kernels/basis_qk.apply_basis``: one Triton launch on
    CUDA, ``k_basis.basis_qk``'s einsums elsewhere)."""
    return apply_basis(q, k, p, p_inv_t)


@basis_qk.register_fake
def _(q: Tensor, k: Tensor, p: Tensor, p_inv_t: Tensor) -> tuple[Tensor, Tensor]:
    return _new_output(q, q.dtype), _new_output(k, k.dtype)


@torch.library.custom_op("kvq::quantize_tc", mutates_args=())
def quantize_tc(x: Tensor, side: str) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (codes [..., D / 2] uint8, side bytes [..., 9] (k) or [..., 6 + D / 16] (v)
    uint8): k already in its basis (``quant_tc.quantize_k``), v rotated here
    (``quant_tc.quantize_v``)."""
    fn = quant_tc.quantize_k if _side(side) == "k" else quant_tc.quantize_v
    codes, aux = fn(x)
    return _new_output(codes, torch.uint8).copy_(codes), _new_output(aux, torch.uint8).copy_(aux)


@quantize_tc.register_fake
def _(x: Tensor, side: str) -> tuple[Tensor, Tensor]:
    d = x.shape[-1]
    quant_tc.check_head_size(d)
    width = quant_tc.K_SIDE if _side(side) == "k" else quant_tc.v_side(d)
    codes = torch.empty((*x.shape[:-1], d // 2), dtype=torch.uint8, device=x.device)
    aux = torch.empty((*x.shape[:-1], width), dtype=torch.uint8, device=x.device)
    return codes, aux


@torch.library.custom_op("kvq::cache_write_tc", mutates_args=("kv_cache", "kv_scale"))
def cache_write_tc(
    k_codes: Tensor,
    v_codes: Tensor,
    k_aux: Tensor,
    v_aux: Tensor,
    kv_cache: Tensor,
    kv_scale: Tensor,
    layer_name: str,
) -> None:
    """Write this batch's codes [T, KH, D / 2] into ``kv_cache`` and their side rows into
    ``kv_scale`` at the batch's slots."""
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    _check_tc_layer(spec, "cache_write_tc")
    md = ctx.metadata_for(spec)
    _check_tc_cache(spec, kv_cache, kv_scale, md)
    n, kh, d = ctx.metadata.num_tokens, spec.num_kv_heads, spec.head_size
    for nm, t, width in (
        ("k_codes", k_codes, d // 2),
        ("v_codes", v_codes, d // 2),
        ("k_aux", k_aux, quant_tc.K_SIDE),
        ("v_aux", v_aux, quant_tc.v_side(d)),
    ):
        _check(
            t.dtype == torch.uint8 and tuple(t.shape) == (n, kh, width),
            f"layer {spec.name!r}: {nm} is {t.dtype} {tuple(t.shape)}, expected uint8 "
            f"{(n, kh, width)}",
        )
    put_tc(kv_cache, kv_scale, k_codes, v_codes, k_aux, v_aux, md.slot_mapping)


@torch.library.custom_op("kvq::quant_cache_write_tc", mutates_args=("kv_cache", "kv_scale"))
def quant_cache_write_tc(
    k: Tensor, v: Tensor, kv_cache: Tensor, kv_scale: Tensor, layer_name: str
) -> None:
    """Fused: quantize k (in its basis) and v [T, KH, D] of the model dtype and write codes and
    side rows, the bytes the unfused form writes (``kernels/kv_write_tc.write_kv_tc``: the Triton
    program on CUDA, aten elsewhere)."""
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    _check_tc_layer(spec, "quant_cache_write_tc")
    md = ctx.metadata_for(spec)
    _check_tc_cache(spec, kv_cache, kv_scale, md)
    want = (ctx.metadata.num_tokens, spec.num_kv_heads, spec.head_size)
    for nm, t in (("k", k), ("v", v)):
        _check(
            t.dtype == spec.model_dtype and tuple(t.shape) == want,
            f"layer {spec.name!r}: {nm} is {t.dtype} {tuple(t.shape)}, expected "
            f"{spec.model_dtype} {want}",
        )
    write_kv_tc(kv_cache, kv_scale, k, v, md.slot_mapping)


@torch.library.custom_op("kvq::paged_attention_tc", mutates_args=())
def paged_attention_tc(q: Tensor, kv_cache: Tensor, kv_scale: Tensor, layer_name: str) -> Tensor:
    """Fused: attention reading the codes and side rows in place. q [T, QH, D] (in the k basis's
    dual, ``basis_qk``) -> [T, QH, D] in q's dtype."""
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    _check_tc_layer(spec, "paged_attention_tc")
    _check_q(spec, q, ctx.metadata.num_tokens)
    _check_tc_cache(spec, kv_cache, kv_scale, ctx.metadata_for(spec))
    return ctx.kernel(layer_name).attend(ctx, spec, q, kv_cache, 1.0, 1.0, None, kv_scale)


@paged_attention_tc.register_fake
def _(q: Tensor, kv_cache: Tensor, kv_scale: Tensor, layer_name: str) -> Tensor:
    return _new_output(q, q.dtype)


@torch.library.custom_op("kvq::dequantize_kv_cache_tc", mutates_args=())
def dequantize_kv_cache_tc(
    kv_cache: Tensor, kv_scale: Tensor, layer_name: str, out_dtype: torch.dtype
) -> Tensor:
    """The read: the batch's pages dequantized (k in its basis, v un-rotated) into a new
    [pages, 2, page, KH, D] tensor of ``out_dtype``; other pages unset (module docstring)."""
    ctx = get_forward_context()
    spec = ctx.spec(layer_name)
    _check_tc_layer(spec, "dequantize_kv_cache_tc")
    md = ctx.metadata_for(spec)
    _check_tc_cache(spec, kv_cache, kv_scale, md)
    out = _dequantized(kv_cache, out_dtype)
    pages = md.kv_indices.long()
    out[pages] = quant_tc.dequantize_pages(kv_cache[pages], kv_scale[pages]).to(out_dtype)
    return out


@dequantize_kv_cache_tc.register_fake
def _(kv_cache: Tensor, kv_scale: Tensor, layer_name: str, out_dtype: torch.dtype) -> Tensor:
    return _dequantized(kv_cache, out_dtype)


def _dequantized(kv_cache: Tensor, out_dtype: torch.dtype) -> Tensor:
    pages, _, page, kh, half = kv_cache.shape
    return torch.empty((pages, 2, page, kh, 2 * half), dtype=out_dtype, device=kv_cache.device)
