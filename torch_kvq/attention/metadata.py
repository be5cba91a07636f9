"""Paged-KV bookkeeping: a page allocator for many sequences and per-batch metadata.

Layout follows FlashInfer: a layer's cache is ``[num_pages, 2, page_size, kv_heads, head_dim]``
(NHD, K at index 0 and V at 1). Every layer shares the same page table, so one ``BatchMetadata``
serves all layers of a forward pass.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from torch_kvq.spec import check_positive_int


class OutOfPagesError(RuntimeError):
    """Raised when a batch needs more KV pages than are free. Nothing was allocated."""


@dataclass(frozen=True)
class GraphShape:
    """The fixed shape of a CUDA-graph-captured decode batch: ``batch_size`` sequences of one new
    token each, at most ``max_pages_per_seq`` pages each. Kernels that see it in the forward
    context plan into buffers of this shape that the captured graph reads (see graph_runner.py)."""

    batch_size: int
    max_pages_per_seq: int


@dataclass(frozen=True)
class BatchMetadata:
    """One forward pass's batch: sequences in order, each with ``qo_lens[i]`` new tokens.

    Tensors (on the cache device; B sequences, T new tokens, N pages in use):
        qo_indptr [B+1] int32: new-token offsets per sequence into the flat token axis.
        kv_indptr [B+1] int32: page offsets per sequence into ``kv_indices``.
        kv_indices [N] int32: page ids, sequence after sequence.
        kv_last_page_len [B] int32: tokens in each sequence's last page (1..page_size).
        seq_lens [B] int32: KV length of each sequence including this step's tokens.
        slot_mapping [T] int64: flat cache slot (page * page_size + offset) of each new token.
        positions [T] int64: position of each new token in its sequence.
    Host copies (``qo_lens``, ``kv_lens``, ``pages_per_seq``, ``kv_indices_host``) let planning
    and the reference kernel avoid device syncs. Building is vectorized (no Python loop over
    pages or tokens) and moves everything to the device in one copy.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    page_size: int
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    pages_per_seq: tuple[int, ...]
    kv_indices_host: torch.Tensor  # [N] int32 on the CPU

    @property
    def num_seqs(self) -> int:
        return len(self.qo_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.qo_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.qo_lens)

    @cached_property
    def max_page_id(self) -> int:
        """The largest page id the batch touches (a layer's cache needs more pages than this)."""
        return int(self.kv_indices_host.max()) if self.kv_indices_host.numel() else -1

    @cached_property
    def page_tables(self) -> tuple[tuple[int, ...], ...]:
        """Each sequence's page ids (host; built on first use, not on the hot path)."""
        flat = self.kv_indices_host.tolist()
        out, start = [], 0
        for n in self.pages_per_seq:
            out.append(tuple(flat[start : start + n]))
            start += n
        return tuple(out)

    @classmethod
    def build(
        cls,
        page_tables: Sequence[Sequence[int] | torch.Tensor],
        kv_lens: Sequence[int],
        qo_lens: Sequence[int],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> BatchMetadata:
        """Build metadata from host page tables (int lists or CPU int tensors); checks them.

        Raises ValueError for mismatched counts, bad lengths, a page table of the wrong size, a
        negative page id, or a page used twice in the batch (two sequences would share KV).
        """
        check_positive_int(page_size, "page_size")
        if not (len(page_tables) == len(kv_lens) == len(qo_lens)) or not qo_lens:
            raise ValueError(
                f"inconsistent batch: {len(page_tables)} page tables, {len(kv_lens)} kv lengths, "
                f"{len(qo_lens)} query lengths (expected equal, non-zero counts)"
            )
        tables = [_page_tensor(i, t) for i, t in enumerate(page_tables)]
        counts = [int(t.numel()) for t in tables]
        for i, (n_pages, kv_len, qo_len) in enumerate(zip(counts, kv_lens, qo_lens)):
            if qo_len < 1 or kv_len < qo_len:
                raise ValueError(
                    f"sequence {i}: query length {qo_len} and kv length {kv_len} are inconsistent "
                    "(expected 1 <= query length <= kv length)"
                )
            need = -(-kv_len // page_size)
            if n_pages != need:
                raise ValueError(
                    f"sequence {i}: kv length {kv_len} needs {need} pages of {page_size}, "
                    f"its page table has {n_pages}"
                )
        kv_indices = torch.cat(tables)
        _check_pages(kv_indices, counts)
        return cls._from_host(kv_indices, counts, list(kv_lens), list(qo_lens), page_size, device)

    @classmethod
    def _from_host(
        cls,
        kv_indices: torch.Tensor,
        counts: list[int],
        kv_lens: list[int],
        qo_lens: list[int],
        page_size: int,
        device: torch.device | str,
    ) -> BatchMetadata:
        parts = host_parts(kv_indices, counts, kv_lens, qo_lens, page_size)
        # one int32 block, one copy; slots and positions widen to int64 on the device
        packed = torch.cat(parts)
        if torch.device(device).type == "cuda":
            packed = packed.pin_memory().to(device, non_blocking=True)
        else:
            packed = packed.to(device)
        a, b, c, d, e, f, g = packed.split([p.numel() for p in parts])
        return cls(
            qo_indptr=a,
            kv_indptr=b,
            kv_indices=c,
            kv_last_page_len=d,
            seq_lens=e,
            slot_mapping=f.to(torch.int64),
            positions=g.to(torch.int64),
            page_size=page_size,
            qo_lens=tuple(int(n) for n in qo_lens),
            kv_lens=tuple(int(n) for n in kv_lens),
            pages_per_seq=tuple(counts),
            kv_indices_host=kv_indices,
        )


def host_parts(
    kv_indices: torch.Tensor,
    counts: list[int],
    kv_lens: list[int],
    qo_lens: list[int],
    page_size: int,
) -> list[torch.Tensor]:
    """The metadata's device tensors, computed on the host (vectorized), all int32: [qo_indptr,
    kv_indptr, kv_indices (as given), kv_last_page_len, seq_lens, slot_mapping, positions].
    ValueError if a slot does not fit int32; nothing else is checked."""
    i64 = torch.int64
    qo = torch.tensor(qo_lens, dtype=i64)
    kv = torch.tensor(kv_lens, dtype=i64)
    n_pages = torch.tensor(counts, dtype=i64)
    zero = torch.zeros(1, dtype=i64)
    qo_indptr = torch.cat([zero, qo.cumsum(0)])
    kv_indptr = torch.cat([zero, n_pages.cumsum(0)])
    T = int(qo_indptr[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(len(qo_lens)), qo, output_size=T)
    positions = (kv - qo)[seq_of_token] + torch.arange(T) - qo_indptr[:-1][seq_of_token]
    page = kv_indices[kv_indptr[:-1][seq_of_token] + positions // page_size].to(i64)
    slots = page * page_size + positions % page_size
    last = kv - (n_pages - 1) * page_size
    top = int(slots.max())  # slots grow with page ids; positions stay below them
    if top >= 2**31:
        raise ValueError(
            f"slot {top} (page id x page_size {page_size} + offset) does not fit int32; "
            "page ids x page_size must stay below 2**31"
        )
    i32 = torch.int32
    small = [t.to(i32) for t in (qo_indptr, kv_indptr, last, kv, slots, positions)]
    return [*small[:2], kv_indices, *small[2:]]


def _page_tensor(i: int, pages: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """A sequence's page ids as a CPU int32 tensor; ValueError for anything but non-negative ints."""
    if isinstance(pages, torch.Tensor):
        if pages.dtype not in (torch.int32, torch.int64) or pages.dim() != 1:
            raise ValueError(
                f"sequence {i}: page table tensor must be 1-D int, got {pages.dtype} {tuple(pages.shape)}"
            )
        return pages.to("cpu", torch.int32)
    for p in pages:
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"sequence {i}: page id {p!r} is not a non-negative int")
    return torch.tensor(list(pages), dtype=torch.int32)


def _check_pages(kv_indices: torch.Tensor, counts: list[int]) -> None:
    if kv_indices.numel() and int(kv_indices.min()) < 0:
        raise ValueError(f"page id {int(kv_indices.min())} is not a non-negative int")
    if kv_indices.numel() and int(torch.bincount(kv_indices).max()) > 1:
        owner: dict[int, int] = {}
        seq_of_page = [i for i, n in enumerate(counts) for _ in range(n)]
        for p, i in zip(kv_indices.tolist(), seq_of_page):
            if p in owner:
                raise ValueError(
                    f"page {p} appears twice in the batch (sequences {owner[p]} and {i}); "
                    "every page must belong to exactly one sequence"
                )
            owner[p] = i


class PageAllocator:
    """Hands out KV pages to sequences: append tokens, free a sequence, reuse its pages.

    Page tables are shared by every layer of a model. Allocation is all-or-nothing: a request that
    does not fit raises ``OutOfPagesError`` and changes nothing.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        check_positive_int(num_pages, "num_pages")
        check_positive_int(page_size, "page_size")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives low ids first
        self._pages: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}
        self._tensors: dict[Hashable, torch.Tensor] = {}  # page lists as int32, rebuilt on change

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> tuple[Hashable, ...]:
        return tuple(self._pages)

    def seq_len(self, seq_id: Hashable) -> int:
        return self._lens[self._known(seq_id)]

    def pages(self, seq_id: Hashable) -> tuple[int, ...]:
        return tuple(self._pages[self._known(seq_id)])

    def _known(self, seq_id: Hashable) -> Hashable:
        if seq_id not in self._pages:
            raise KeyError(f"unknown sequence {seq_id!r}; known: {list(self._pages)[:8]}")
        return seq_id

    def _pages_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        have = len(self._pages.get(seq_id, ()))
        total = self._lens.get(seq_id, 0) + num_tokens
        return max(0, -(-total // self.page_size) - have)

    def append(self, seq_id: Hashable, num_tokens: int) -> None:
        """Reserve room for ``num_tokens`` more tokens of ``seq_id`` (new ids start at 0)."""
        self.append_many([(seq_id, num_tokens)])

    def append_many(self, requests: Sequence[tuple[Hashable, int]]) -> None:
        """Reserve for several sequences at once; all-or-nothing."""
        ids = [sid for sid, _ in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a batch names a sequence twice: {ids}")
        for sid, n in requests:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"sequence {sid!r}: token count must be a positive int, got {n!r}")
        needs = [self._pages_needed(sid, n) for sid, n in requests]
        need = sum(needs)
        if need > len(self._free):
            raise OutOfPagesError(
                f"out of KV pages: the batch needs {need} new pages of {self.page_size} tokens, "
                f"{len(self._free)} of {self.num_pages} are free; free finished sequences or "
                "allocate a larger cache. Nothing was allocated."
            )
        for (sid, n), new in zip(requests, needs):
            pages = self._pages.setdefault(sid, [])
            added = [self._free.pop() for _ in range(new)]
            pages.extend(added)
            old = self._tensors.get(sid)
            if old is None:
                self._tensors[sid] = torch.tensor(pages, dtype=torch.int32)
            elif added:  # extend in C, not rebuild from the Python list (a long context: ~1k ids)
                self._tensors[sid] = torch.cat([old, torch.tensor(added, dtype=torch.int32)])
            self._lens[sid] = self._lens.get(sid, 0) + n

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's pages for reuse."""
        pages = self._pages.pop(self._known(seq_id))
        del self._lens[seq_id]
        self._tensors.pop(seq_id, None)
        self._free.extend(reversed(pages))

    def build_batch(
        self, requests: Sequence[tuple[Hashable, int]], device: torch.device | str = "cpu"
    ) -> BatchMetadata:
        """Reserve ``requests`` = [(seq_id, new_tokens), ...] and return the batch's metadata.

        The new tokens of sequence i occupy ``qo_indptr[i]:qo_indptr[i+1]`` of the flat token axis.
        """
        self.append_many(requests)
        ids = [sid for sid, _ in requests]
        # The allocator's own tables are consistent by construction (sizes match the lengths,
        # pages are owned once), so skip BatchMetadata.build's checks: this runs every step.
        tables = [self._tensors[sid] for sid in ids]
        return BatchMetadata._from_host(
            torch.cat(tables),
            [t.numel() for t in tables],
            [self._lens[sid] for sid in ids],
            [n for _, n in requests],
            self.page_size,
            device,
        )
