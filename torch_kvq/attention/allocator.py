"""The page allocator: KV pages for many sequences, one pool per cache group.

A *cache group* is the layers that read the same page table. Full-attention layers form one group
(pool ``num_pages``). With ``window_pages={window: pages}``, the layers of each sliding window get
their own pool and page tables, and a sequence keeps only the pages its window can still read:
before a step whose queries start at position ``p``, the pages wholly below ``p - window + 1``
are released and reused (and when a pool runs short, those of sequences outside the batch below
their ``length - window + 1``: their next query is at their length) (vLLM's hybrid KV-cache manager, SGLang's sliding-window pool). Memory
then follows the per-layer spec: a sliding layer holds about ``window`` tokens per sequence, not
the whole context. Without ``window_pages`` every layer reads the one full table (and a sliding
layer's cache needs ``num_pages`` pages like the others).

Page ids index each layer's own cache tensor, so a group's layers may differ in cache dtype (FP8
and bf16 layers of one window share a table; their bytes per page differ). Allocation is
all-or-nothing across every pool: a request that does not fit raises ``OutOfPagesError`` and
changes nothing (no page released, none taken).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from torch_kvq.attention.metadata import BatchMetadata
from torch_kvq.spec import check_positive_int


class OutOfPagesError(RuntimeError):
    """Raised when a batch needs more KV pages than are free. Nothing was allocated."""


@dataclass
class _Table:
    """One sequence's live pages in one pool; ``released`` pages before them were given back."""

    pages: list[int] = field(default_factory=list)
    released: int = 0
    tensor: torch.Tensor | None = None  # ``pages`` as int32, extended on change


class _Pool:
    """A group's page ids: a stack of freed ids (reused first) over never-used ones (low first)."""

    def __init__(self, num_pages: int, window: int | None) -> None:
        self.num_pages = num_pages
        self.window = window
        self.free: list[int] = []
        self.fresh = 0
        self.tables: dict[Hashable, _Table] = {}

    @property
    def num_free(self) -> int:
        return len(self.free) + self.num_pages - self.fresh

    def plan(
        self, seq_id: Hashable, old_len: int, new_tokens: int, page_size: int
    ) -> tuple[int, int]:
        """(pages to release from the front, new pages to take) for appending ``new_tokens``."""
        table = self.tables.get(seq_id)
        live, released = (len(table.pages), table.released) if table else (0, 0)
        total = -(-(old_len + new_tokens) // page_size)
        drop = 0
        if (
            self.window is not None
        ):  # this step's first query (at old_len) reads keys > old_len - window
            first_needed = max(0, old_len - self.window + 1)
            drop = max(0, first_needed // page_size - released)
        return drop, total - released - live

    def apply(self, seq_id: Hashable, drop: int, take: int) -> None:
        table = self.tables.setdefault(seq_id, _Table())
        if drop:
            gone, table.pages = table.pages[:drop], table.pages[drop:]
            table.released += drop
            self.give(gone)
        added = []
        for _ in range(take):
            if self.free:
                added.append(self.free.pop())
            else:
                added.append(self.fresh)
                self.fresh += 1
        table.pages.extend(added)
        if table.tensor is None or drop:
            table.tensor = torch.tensor(table.pages, dtype=torch.int32)
        elif added:  # extend in C, not rebuild from the Python list (a long context: ~1k ids)
            table.tensor = torch.cat([table.tensor, torch.tensor(added, dtype=torch.int32)])

    def give(self, pages: Sequence[int]) -> None:
        self.free.extend(reversed(pages))


class PageAllocator:
    """Hands out KV pages to sequences: append tokens, free a sequence, reuse its pages.

    Args:
        num_pages: the full-attention pool: pages of each full-attention layer's cache (and of
            every sliding layer's cache when it has no pool of its own).
        page_size: tokens per page.
        window_pages: ``{window: pages}``, a pool of its own for the layers of each sliding
            window, whose pages outside the window are released (see the module docstring).
            Each such layer's cache has that many pages. Empty: every layer shares one table.

    Allocation is all-or-nothing across every pool: ``OutOfPagesError`` and nothing changed.
    """

    def __init__(
        self, num_pages: int, page_size: int, window_pages: Mapping[int, int] | None = None
    ) -> None:
        check_positive_int(num_pages, "num_pages")
        check_positive_int(page_size, "page_size")
        windows = dict(window_pages or {})
        for w, n in windows.items():
            check_positive_int(w, "window_pages window")
            check_positive_int(n, f"window_pages[{w}]")
        self.num_pages = num_pages
        self.page_size = page_size
        self.window_pages: dict[int, int] = dict(sorted(windows.items()))
        self._full = _Pool(num_pages, None)
        self._pools = [self._full] + [_Pool(n, w) for w, n in self.window_pages.items()]
        self._lens: dict[Hashable, int] = {}

    def _pool(self, window: int | None) -> _Pool:
        for pool in self._pools:
            if pool.window == window:
                return pool
        raise KeyError(
            f"no page pool for window {window!r}; pools: full"
            + "".join(f", window {w}" for w in self.window_pages)
        )

    @property
    def num_free_pages(self) -> int:
        """Free pages of the full-attention pool."""
        return self._full.num_free

    def free_pages(self, window: int | None = None) -> int:
        """Free pages of the pool of ``window`` (None: the full-attention pool)."""
        return self._pool(window).num_free

    @property
    def sequences(self) -> tuple[Hashable, ...]:
        return tuple(self._lens)

    def seq_len(self, seq_id: Hashable) -> int:
        return self._lens[self._known(seq_id)]

    def pages(self, seq_id: Hashable, window: int | None = None) -> tuple[int, ...]:
        """The sequence's live pages in the pool of ``window`` (None: its whole context)."""
        return tuple(self._pool(window).tables[self._known(seq_id)].pages)

    def released_pages(self, seq_id: Hashable, window: int) -> int:
        """How many of the sequence's first pages the pool of ``window`` has released."""
        return self._pool(window).tables[self._known(seq_id)].released

    def _known(self, seq_id: Hashable) -> Hashable:
        if seq_id not in self._lens:
            raise KeyError(f"unknown sequence {seq_id!r}; known: {list(self._lens)[:8]}")
        return seq_id

    def append(self, seq_id: Hashable, num_tokens: int) -> None:
        """Reserve room for ``num_tokens`` more tokens of ``seq_id`` (new ids start at 0)."""
        self.append_many([(seq_id, num_tokens)])

    def append_many(self, requests: Sequence[tuple[Hashable, int]]) -> None:
        """Reserve for several sequences at once; all-or-nothing across every pool."""
        ids = [sid for sid, _ in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"a batch names a sequence twice: {ids}")
        for sid, n in requests:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"sequence {sid!r}: token count must be a positive int, got {n!r}")
        plans = []
        for pool in self._pools:
            moves = [
                pool.plan(sid, self._lens.get(sid, 0), n, self.page_size) for sid, n in requests
            ]
            need = sum(take for _, take in moves) - sum(drop for drop, _ in moves)
            trims: list[tuple[Hashable, int]] = []
            if need > pool.num_free and pool.window is not None:
                # short: also trim sequences outside the batch (their next query is at their
                # length, so the pages below length - window + 1 are dead); off the hot path
                batch = set(ids)
                trims = [(sid, pool.plan(sid, n, 0, self.page_size)[0])
                         for sid, n in self._lens.items() if sid not in batch]  # fmt: skip
                need -= sum(drop for _, drop in trims)
            if need > pool.num_free:
                where = "" if pool.window is None else f" in the pool of window {pool.window}"
                raise OutOfPagesError(
                    f"out of KV pages{where}: the batch needs {need} new pages of "
                    f"{self.page_size} tokens, {pool.num_free} of {pool.num_pages} are free; free "
                    "finished sequences or allocate a larger cache. Nothing was allocated."
                )
            plans.append((moves, trims))
        for pool, (moves, trims) in zip(self._pools, plans):
            releases = [(sid, drop) for sid, (drop, _) in zip(ids, moves)] + trims
            for sid, drop in releases:  # release first: reusable at once
                if drop:
                    pool.apply(sid, drop, 0)
            for sid, (_, take) in zip(ids, moves):
                pool.apply(sid, 0, take)
        for sid, n in requests:
            self._lens[sid] = self._lens.get(sid, 0) + n

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's pages (in every pool) for reuse."""
        del self._lens[self._known(seq_id)]
        for pool in self._pools:
            pool.give(pool.tables.pop(seq_id).pages)

    def build_batch(
        self, requests: Sequence[tuple[Hashable, int]], device: torch.device | str = "cpu"
    ) -> BatchMetadata:
        """Reserve ``requests`` = [(seq_id, new_tokens), ...] and return the batch's metadata:
        the full table, plus one table per windowed pool (``md.for_window(window)``).

        The new tokens of sequence i occupy ``qo_indptr[i]:qo_indptr[i+1]`` of the flat token axis.
        """
        self.append_many(requests)
        qo_lens = [n for _, n in requests]
        md = self._table_metadata(self._full, requests, qo_lens, device)
        if len(self._pools) == 1:
            return md
        windows = tuple(
            (pool.window, self._table_metadata(pool, requests, qo_lens, device, md.positions))
            for pool in self._pools[1:]
        )
        return dataclasses.replace(md, windows=windows)

    def _table_metadata(
        self,
        pool: _Pool,
        requests: Sequence[tuple[Hashable, int]],
        qo_lens: list[int],
        device: torch.device | str,
        positions: torch.Tensor | None = None,
    ) -> BatchMetadata:
        # The allocator's own tables are consistent by construction (sizes match the lengths,
        # pages are owned once), so skip BatchMetadata.build's checks: this runs every step.
        tables = [pool.tables[sid] for sid, _ in requests]
        tensors = [t.tensor for t in tables]
        assert all(t is not None for t in tensors)
        kv_lens = [
            self._lens[sid] - t.released * self.page_size for (sid, _), t in zip(requests, tables)
        ]
        md = BatchMetadata._from_host(
            torch.cat(tensors),  # type: ignore[arg-type]
            [len(t.pages) for t in tables],
            kv_lens,
            qo_lens,
            self.page_size,
            device,
        )
        return md if positions is None else dataclasses.replace(md, positions=positions)
