"""PageAllocator and BatchMetadata."""

from __future__ import annotations

import pytest
import torch

from torch_kvq.attention.allocator import OutOfPagesError, PageAllocator
from torch_kvq.attention.metadata import BatchMetadata


def test_build_batch_layout() -> None:
    alloc = PageAllocator(num_pages=8, page_size=4)
    md = alloc.build_batch([("a", 5), ("b", 1), ("c", 4)])
    assert md.qo_indptr.tolist() == [0, 5, 6, 10]
    assert md.kv_indptr.tolist() == [0, 2, 3, 4]
    assert md.kv_indices.tolist() == [0, 1, 2, 3]
    assert md.kv_last_page_len.tolist() == [1, 1, 4]
    assert md.seq_lens.tolist() == [5, 1, 4]
    assert md.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 12, 13, 14, 15]
    assert md.positions.tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3]
    assert md.num_tokens == 10 and md.num_seqs == 3 and not md.is_decode_only
    assert md.qo_indptr.dtype == torch.int32 and md.slot_mapping.dtype == torch.int64


def test_decode_step_appends_in_place() -> None:
    alloc = PageAllocator(num_pages=8, page_size=4)
    alloc.build_batch([("a", 4), ("b", 2)])
    md = alloc.build_batch([("a", 1), ("b", 1)])
    assert md.is_decode_only
    assert md.seq_lens.tolist() == [5, 3]
    assert alloc.pages("a") == (0, 2)  # a's second page allocated after b's first
    assert md.slot_mapping.tolist() == [2 * 4 + 0, 1 * 4 + 2]
    assert md.positions.tolist() == [4, 2]


def test_free_and_reuse() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    alloc.append("a", 4)
    alloc.append("b", 2)
    assert alloc.num_free_pages == 1
    a_pages = alloc.pages("a")
    alloc.free("a")
    assert alloc.num_free_pages == 3
    alloc.append("c", 4)
    assert set(alloc.pages("c")) <= set(a_pages) | {3}
    assert alloc.pages("b") == (2,)
    with pytest.raises(KeyError, match="unknown sequence 'a'"):
        alloc.free("a")


def test_out_of_pages_changes_nothing() -> None:
    alloc = PageAllocator(num_pages=4, page_size=4)
    alloc.append("a", 6)
    before = (alloc.pages("a"), alloc.seq_len("a"), alloc.num_free_pages)
    with pytest.raises(
        OutOfPagesError,
        match=r"needs 3 new pages of 4 tokens, 2 of 4 are free.*Nothing was allocated",
    ):
        alloc.build_batch([("a", 2), ("b", 9)])  # a fits alone, b does not: all-or-nothing
    assert (alloc.pages("a"), alloc.seq_len("a"), alloc.num_free_pages) == before
    assert alloc.sequences == ("a",)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_token_counts(bad: object) -> None:
    with pytest.raises(ValueError, match="token count must be a positive int"):
        PageAllocator(4, 4).append("a", bad)  # type: ignore[arg-type]


def test_duplicate_sequence_in_batch() -> None:
    with pytest.raises(ValueError, match="names a sequence twice"):
        PageAllocator(4, 4).build_batch([("a", 1), ("a", 1)])


def test_inconsistent_metadata_is_rejected() -> None:
    with pytest.raises(ValueError, match="needs 2 pages of 4, its page table has 1"):
        BatchMetadata.build([[0]], kv_lens=[5], qo_lens=[5], page_size=4)
    with pytest.raises(ValueError, match="inconsistent"):
        BatchMetadata.build([[0]], kv_lens=[2], qo_lens=[3], page_size=4)
    with pytest.raises(ValueError, match="inconsistent batch"):
        BatchMetadata.build([[0], [1]], kv_lens=[2], qo_lens=[2], page_size=4)
