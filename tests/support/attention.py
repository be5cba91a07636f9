"""Attention-layer test helpers: layers over a shared allocator, strided q/k/v views, opcheck of
the kvq ops on them."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch

from torch_kvq.attention import Attention, PageAllocator, ReferenceKernel, forward_context
from torch_kvq.attention.context import get_forward_context
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig
from torch_kvq.spec_resolve import resolve_layer_specs

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


@contextlib.contextmanager
def per_token_head_case(mode: str) -> Iterator[tuple]:
    """Two layers of ``mode`` (layer 0 skipped), pages of 4, a batch of 5 + 1 + 3 tokens and its
    q [T, 8, 32] / k / v [T, 2, 32] bf16 (k rows of varied range), inside a forward context on the
    reference kernel: (specs, layers, q, k, v, metadata)."""
    cfg = KVCacheConfig(mode, skip_layers=(0,), page_size=4)
    specs, attns = make_layers(cfg, num_pages=8)
    md = PageAllocator(8, 4).build_batch([("a", 5), ("b", 1), ("c", 3)])
    g = torch.Generator().manual_seed(0)
    T = md.num_tokens
    q = torch.randn(T, 8, 32, generator=g).bfloat16()
    k = (torch.randn(T, 2, 32, generator=g) * torch.rand(T, 2, 1, generator=g) * 4).bfloat16()
    v = torch.randn(T, 2, 32, generator=g).bfloat16()
    with forward_context(md, specs, ReferenceKernel()):
        yield specs, attns, q, k, v, md


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
        torch.ops.kvq.dequantize_kv_cache_tc.default,
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


def k_basis(kh: int = 2, d: int = 32, seed: int = 0):
    """A well-conditioned K basis of a tc4 layer, per kv head (identity plus noise), as a
    calibration gives."""
    from torch_kvq.spec_channels import KBasis

    g = torch.Generator().manual_seed(seed)
    return KBasis.of(torch.eye(d) + torch.randn(kh, d, d, generator=g) / d**0.5)
