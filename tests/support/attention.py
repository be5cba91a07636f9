"""Attention-layer test helpers: layers over a shared allocator, strided q/k/v views, opcheck of
the kvq ops on them."""

from __future__ import annotations

import itertools

import torch

from torch_kvq.attention import Attention
from torch_kvq.attention.context import get_forward_context
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig, resolve_layer_specs

_ids = itertools.count()


def make_layers(
    cfg: KVCacheConfig,
    n: int = 2,
    heads=(8, 2),
    head_size=32,
    window=6,
    soft_cap=None,
    dtype=torch.bfloat16,
    num_pages=16,
    quant_form="op",
):
    """n Attention layers; even layers sliding (window), odd global. Unique names per call."""
    tag = next(_ids)
    infos = [
        AttentionLayerInfo(
            f"t{tag}.layers.{i}.attn",
            heads[0],
            heads[1],
            head_size,
            sliding_window=window if i % 2 == 0 else None,
            logits_soft_cap=soft_cap,
        )
        for i in range(n)
    ]
    specs = resolve_layer_specs(cfg, infos, dtype)
    return specs, [Attention(s, num_pages, quant_form=quant_form) for s in specs]


# q / k / v layouts a model hands over: each a non-contiguous view holding the same values
VIEW_LAYOUTS = ("hf_transposed", "fused_qkv", "strided_inner")


def as_view(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` [T, H, D] as a non-contiguous view with the same values (any dtype, FP8 too).

    ``hf_transposed``: a [1, H, T, D] tensor ``.transpose(1, 2).reshape(T, H, D)`` (what Hugging
    Face attention modules hand over); ``fused_qkv``: the middle third of a fused projection's
    output (row stride 3 * H * D); ``strided_inner``: every other element of the last dim.
    """
    t, h, d = x.shape
    new = dict(dtype=x.dtype, device=x.device)
    if layout == "hf_transposed":
        view = torch.empty(1, h, t, d, **new).transpose(1, 2).reshape(t, h, d)
    elif layout == "fused_qkv":
        view = torch.empty(t, 3 * h, d, **new)[:, h : 2 * h]
    elif layout == "strided_inner":
        view = torch.empty(t, h, 2 * d, **new)[..., ::2]
    else:
        raise ValueError(f"unknown layout {layout!r}; expected one of {VIEW_LAYOUTS}")
    view.copy_(x)
    assert t == 1 or not view.is_contiguous(), layout
    return view


def as_cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """A paged cache [pages, 2, page, KH, D] as a view of a [2, pages, page, KH, D] buffer (k and
    v in separate halves); each page's [KH, D] rows stay dense."""
    view = torch.empty_like(kv_cache.transpose(0, 1), memory_format=torch.contiguous_format)
    view = view.transpose(0, 1)
    view.copy_(kv_cache)
    assert not view.is_contiguous()
    return view


def opcheck(op, args) -> None:
    """``torch.library.opcheck``; for the ``kvq::dequantize_kv_cache*`` ops without the AOT-dispatch
    tests, which compare whole outputs: its pages outside the batch are left unset (so the unfused
    read costs what the batch reads, not the pool), and ``check_ops_on_views`` / the op tests
    compare the batch's pages instead."""
    utils = None
    if op in (
        torch.ops.kvq.dequantize_kv_cache.default,
        torch.ops.kvq.dequantize_kv_cache_per_token_head.default,
    ):
        utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    if utils is None:
        torch.library.opcheck(op, args)
    else:
        torch.library.opcheck(op, args, test_utils=utils)


def check_ops_on_views(cases, exact: bool = True) -> None:
    """``cases``: (op packet, args with views, the same args contiguous); tensor args are never
    mutated in place. Each op passes ``opcheck`` on the views (its fake gives the real strides);
    it returns a new contiguous tensor (a write op: writes the cache) equal to what the contiguous
    args give: bitwise if ``exact``, else to about 1e-2 (kernels whose reductions may reorder)."""
    for op, view_args, args in cases:
        opcheck(op.default, view_args)
        if op in (torch.ops.kvq.cache_write, torch.ops.kvq.quant_cache_write):
            got, want = view_args[2].clone(), args[2].clone()
            op(*view_args[:2], got, *view_args[3:])
            op(*args[:2], want, *args[3:])
        else:
            got, want = op(*view_args), op(*args)
            assert got.is_contiguous() and got.stride() == want.stride(), (op, got.stride())
            if op is torch.ops.kvq.dequantize_kv_cache:  # only the batch's pages are defined
                pages = get_forward_context().metadata.kv_indices.long()
                got, want = got[pages], want[pages]
        assert got.dtype == want.dtype, op
        if exact:
            if got.dtype == torch.float8_e4m3fn:
                got, want = got.view(torch.uint8), want.view(torch.uint8)
            assert torch.equal(got, want), op
        else:  # one e4m3 step is 2**-3 relative
            rtol = 0.13 if got.dtype == torch.float8_e4m3fn else 1e-2
            torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=rtol, msg=str(op))
