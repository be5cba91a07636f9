"""Per-batch paged-KV metadata: one ``BatchMetadata`` per forward pass, one page table per cache
group inside it (the allocator is allocator.py).

Layout follows FlashInfer: a layer's cache is ``[num_pages, 2, page_size, kv_heads, head_dim]``
(NHD, K at index 0 and V at 1). Full-attention layers read the batch's own table; a sliding-window
layer reads ``md.for_window(window)``: its group's table, which holds only the pages its window
can still read, when the allocator gives that window a pool of its own, else the full table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from torch_kvq.spec import check_positive_int


@dataclass(frozen=True)
class GraphShape:
    """The fixed shape of a CUDA-graph-captured decode batch: ``batch_size`` sequences of one new
    token each, at most ``max_pages_per_seq`` pages each. Kernels that see it in the forward
    context plan into buffers of this shape that the captured graph reads (see graph_runner.py)."""

    batch_size: int
    max_pages_per_seq: int
    windows: tuple[tuple[int, int], ...] = ()  # (window, max pages per sequence) of windowed tables

    def for_window(self, window: int | None) -> GraphShape:
        """The shape of the table that layers of ``window`` read (see ``BatchMetadata.for_window``)."""
        for w, pages in self.windows:
            if w == window:
                return GraphShape(self.batch_size, pages)
        return self


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
    and the reference kernel avoid device syncs.

    ``windows`` holds the tables of windowed cache groups, ``(window, BatchMetadata)``: the same
    sequences and new tokens, but only the pages still inside the window, so their ``kv_lens``,
    ``seq_lens`` and ``slot_mapping`` count from the first live page (attention is relative:
    dropping whole leading pages shifts queries and keys alike); ``positions`` stay the tokens' own. Building is vectorized (no Python loop over
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
    windows: tuple[tuple[int, BatchMetadata], ...] = ()

    def for_window(self, window: int | None) -> BatchMetadata:
        """The table that layers with sliding window ``window`` read: their group's own when the
        batch has one, else this one (the full table serves every window: the kernel masks)."""
        for w, md in self.windows:
            if w == window:
                return md
        return self

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
