from __future__ import annotations

import itertools

import pytest
import torch

from torch_kvq.attention import Attention, PageAllocator
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


@pytest.fixture
def alloc() -> PageAllocator:
    return PageAllocator(num_pages=16, page_size=4)
