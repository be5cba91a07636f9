"""Windowed page pools: sliding-window layers keep only the pages their window can read.

The allocator releases and reuses pages (all-or-nothing across pools); a model with windowed
pools gives the same tokens and logits as the same model on one shared table, eagerly, through
the fixed-buffer graph path, and compiled; its sliding layers' caches are the window's size.
"""

from __future__ import annotations

import pytest
import torch

from torch_kvq import KVCacheConfig
from torch_kvq.attention import OutOfPagesError, PageAllocator
from torch_kvq.attention.graph_runner import DecodeGraphRunner
from torch_kvq.models import build_model, generate


def test_pages_outside_the_window_are_released_and_reused() -> None:
    alloc = PageAllocator(num_pages=16, page_size=4, window_pages={6: 5})
    md = alloc.build_batch([("a", 10)])  # prefill: every query reads back to its own window
    assert alloc.pages("a", 6) == (0, 1, 2) and alloc.released_pages("a", 6) == 0
    assert md.for_window(6).page_tables == ((0, 1, 2),)
    md = alloc.build_batch([("a", 1)])  # token 10 reads 5..10: page 0 (tokens 0..3) is released
    assert alloc.released_pages("a", 6) == 1 and alloc.pages("a", 6) == (1, 2)
    table = md.for_window(6)
    assert table.kv_lens == (7,) and table.seq_lens.tolist() == [7]
    assert table.slot_mapping.tolist() == [2 * 4 + 2]  # token 10: 3rd slot of page 2
    assert table.positions.tolist() == md.positions.tolist() == [10]  # the token's own position
    assert md.kv_lens == (11,) and alloc.pages("a") == (0, 1, 2)  # the full table keeps all
    alloc.build_batch([("b", 4)])
    assert alloc.pages("b", 6) == (0,)  # the released page is reused first
    assert alloc.free_pages(6) == 5 - 3
    assert md.for_window(99) is md  # a window without a pool reads the full table


def test_refusal_in_one_pool_changes_no_pool() -> None:
    alloc = PageAllocator(num_pages=16, page_size=4, window_pages={4: 3})
    alloc.append("a", 8)
    before = (alloc.pages("a"), alloc.pages("a", 4), alloc.free_pages(), alloc.free_pages(4))
    with pytest.raises(OutOfPagesError, match="in the pool of window 4.*Nothing was allocated"):
        alloc.build_batch([("a", 1), ("b", 9)])  # the full pool fits; the window pool does not
    assert (
        alloc.pages("a"),
        alloc.pages("a", 4),
        alloc.free_pages(),
        alloc.free_pages(4),
    ) == before
    assert alloc.released_pages("a", 4) == 0 and alloc.sequences == ("a",)


def test_released_pages_fund_the_same_batch() -> None:
    """A step may give one sequence the pages it releases for another."""
    alloc = PageAllocator(num_pages=32, page_size=2, window_pages={2: 3})
    alloc.append("a", 6)  # 3 pages: the window pool is full
    alloc.append("a", 1)  # token 6 reads 5..6: the pages of tokens 0..3 go, one page comes
    assert alloc.released_pages("a", 2) == 2 and alloc.free_pages(2) == 1
    alloc.build_batch([("a", 1), ("b", 3)])  # b needs 2 pages: 1 free + the one a releases
    assert alloc.released_pages("a", 2) == 3 and len(alloc.pages("b", 2)) == 2
    assert alloc.free_pages(2) == 0


def test_bad_window_pages() -> None:
    with pytest.raises(ValueError, match=r"window_pages\[4\] must be a positive int"):
        PageAllocator(8, 4, {4: 0})
    with pytest.raises(KeyError, match="no page pool for window 7"):
        PageAllocator(8, 4, {4: 2}).free_pages(7)
    kv = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=4)
    with pytest.raises(ValueError, match=r"names windows \[5\] that no layer has.*\[8\]"):
        build_model("gemma3-tiny", kv, window_pages={5: 4})
    with pytest.raises(ValueError, match="window_pages must be a positive int"):
        build_model("gemma3-tiny", kv, window_pages=-1)


MIXED = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=4)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5] * 3, [7, 8] * 9]  # beyond the window of 8


def _same(got, want) -> None:
    assert got.tokens == want.tokens
    for g, w in zip(got.logits, want.logits):  # fewer keys to mask out: the sums may reorder
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def _pair(**kw):
    shared = build_model("gemma3-tiny", MIXED, num_pages=64, dtype=torch.float32, **kw)
    pooled = build_model(
        "gemma3-tiny", MIXED, num_pages=64, window_pages=12, dtype=torch.float32, **kw
    )
    return shared, pooled


def test_model_caches_follow_the_window() -> None:
    _, pooled = _pair()
    pages = {a.spec.sliding_window: a.kv_cache.shape[0] for a in pooled.attention_layers}
    assert pages == {8: 12, None: 64}
    assert pooled.allocator.window_pages == {8: 12}


def test_windowed_pools_give_the_same_generation() -> None:
    shared, pooled = _pair()
    want = generate(shared, PROMPTS, max_new_tokens=12)
    got = generate(pooled, PROMPTS, max_new_tokens=12)
    _same(got, want)
    assert pooled.allocator.free_pages(8) == 12 and pooled.allocator.sequences == ()


def test_windowed_pools_through_the_fixed_buffer_graph_path() -> None:
    """The runner stages one table per pool and pads each with its own scratch page."""
    shared, pooled = _pair()
    want = generate(shared, PROMPTS, max_new_tokens=10)
    with DecodeGraphRunner(pooled, batch_sizes=(4,), max_context=40, capture=False) as runner:
        assert set(runner.scratch_pages) == {None, 8}
        got = generate(pooled, PROMPTS, max_new_tokens=10, decode=runner)
    _same(got, want)


def test_windowed_pools_compiled() -> None:
    from torch_kvq import kvq_backend

    shared, pooled = _pair()
    want = generate(shared, PROMPTS, max_new_tokens=6)
    compiled = torch.compile(pooled, backend=kvq_backend)
    _same(generate(pooled, PROMPTS, max_new_tokens=6, forward=compiled), want)


def test_runner_refuses_a_batch_without_the_window_table() -> None:
    from torch_kvq.attention import BatchMetadata

    _, pooled = _pair()
    runner = DecodeGraphRunner(pooled, batch_sizes=(2,), max_context=40, capture=False)
    md = BatchMetadata.build([[5]], [1], [1], 4)  # a full table only
    with pytest.raises(ValueError, match="no page table for window 8"):
        runner(torch.zeros(1, dtype=torch.long), md)
