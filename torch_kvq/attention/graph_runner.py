"""CUDA graphs for the decode step: capture once per batch size, then plan + replay.

A decode step of a small model is launch-bound: the host spends longer issuing ~10 ops per layer
than the GPU spends running them. ``DecodeGraphRunner`` captures the whole step (the compiled or
eager model, every ``kvq::*`` op and its kernels) into one CUDA graph per batch size and replays
it. Per step, outside the graph, it only

1. pads the batch to the next captured size (padding rows: one token on a scratch page that the
   runner reserves in the model's allocator, so they never touch a real sequence's KV),
2. copies the page table, positions and slots into the graph's fixed buffers (two pinned copies),
3. plans the kernels for that shape (``forward_context(..., graph=GraphShape)``: FlashInfer
   refills its fixed wrapper buffers and XQA block table in place), and replays.

Host-side checks that the ops make while tracing do not run on replay, so ``__call__`` checks the
batch itself (decode-only, size, context, page range) and raises, naming the bad value.

    runner = DecodeGraphRunner(model, torch.compile(model, backend=kvq_backend),
                               batch_sizes=(8, 16, 32, 64), max_context=16384)
    md = model.allocator.build_batch([(seq, 1) for seq in seqs], device="cpu")
    logits = runner(input_ids, md)          # [len(seqs), vocab] fp32, a fresh tensor
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torch_kvq.attention.context import forward_context
from torch_kvq.attention.metadata import BatchMetadata, GraphShape, host_parts
from torch_kvq.spec import check_positive_int

# runner N's scratch page belongs to the allocator sequence f"{PAD_SEQUENCE}.{N}"
PAD_SEQUENCE = "torch_kvq.graph_padding"
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
_runner_ids = itertools.count(1)


class _Slot:
    """One batch size's fixed buffers, its graph and its output.

    Device buffers, one page table per cache group (the full table first, then each window's):
    ``i32`` = qo_indptr [B+1], then per table kv_indptr [B+1] | last_page_len [B] | seq_lens [B],
    then per table kv_indices [B * max_pages] (the full table's last, so a step copies only up to
    its used end); ``i64`` = per table slot_mapping [B], then positions [B] | input_ids [B], each
    16-byte aligned (compiled graphs take the last two as inputs). Both have pinned host twins
    that stage the step's values.
    """

    def __init__(self, shape: GraphShape, page_size: int, device: torch.device) -> None:
        b = shape.batch_size
        self.shape = shape
        self.page_size = page_size
        self.windows: tuple[int | None, ...] = (*(w for w, _ in shape.windows), None)
        widths = [shape.for_window(w).max_pages_per_seq for w in self.windows]
        self.index_at = [b + 1 + len(widths) * (3 * b + 1)]
        for w in widths:
            self.index_at.append(self.index_at[-1] + b * w)
        pin = device.type == "cuda"
        self.i32 = torch.zeros(self.index_at[-1], dtype=torch.int32, device=device)
        self.stride = c = b + b % 2  # 16-byte alignment of each int64 part
        n64 = len(widths) * c
        self.i64 = torch.zeros(n64 + 2 * c, dtype=torch.int64, device=device)
        self.host_i32 = torch.zeros(self.i32.shape, dtype=torch.int32, pin_memory=pin)
        self.host_i64 = torch.zeros(self.i64.shape, dtype=torch.int64, pin_memory=pin)
        self.copied = torch.cuda.Event() if pin else None  # host twins are free again after it
        self.positions = self.i64[n64 : n64 + b]
        self.input_ids = self.i64[n64 + c : n64 + c + b]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None

    def fill(
        self, md: BatchMetadata, input_ids: torch.Tensor, scratch: dict[int | None, int]
    ) -> BatchMetadata:
        """Stage ``md`` padded to this slot's size (padding rows: one token on the group's
        ``scratch`` page), copy it to the device, return the metadata whose device tensors are
        views of the fixed buffers."""
        b, c = self.shape.batch_size, self.stride
        pad = b - md.num_seqs
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copies have left the host twins
        h32, h64, v32, v64 = self.host_i32, self.host_i64, self.i32, self.i64
        tables: dict[int | None, BatchMetadata] = {}
        for t, window in enumerate(self.windows):
            src = md.for_window(window)
            counts = [*src.pages_per_seq, *([1] * pad)]
            kv_lens = [*src.kv_lens, *([1] * pad)]
            kv_indices = torch.cat(
                [src.kv_indices_host, torch.full((pad,), scratch[window], dtype=torch.int32)]
            )
            qo, kv_ptr, idx, last, seq_lens, slots, positions = host_parts(
                kv_indices, counts, kv_lens, [1] * b, self.page_size
            )
            o = b + 1 + t * (3 * b + 1)  # this table's kv_indptr | last | seq_lens
            torch.cat([kv_ptr, last, seq_lens], out=h32[o : o + 3 * b + 1])
            at = self.index_at[t]
            h32[at : at + idx.numel()] = idx
            h64[t * c : t * c + b] = slots
            if window is None:
                h32[: b + 1] = qo
                h64[len(self.windows) * c : len(self.windows) * c + b] = positions
                used = at + idx.numel()
            tables[window] = BatchMetadata(
                qo_indptr=v32[: b + 1],
                kv_indptr=v32[o : o + b + 1],
                kv_last_page_len=v32[o + b + 1 : o + 2 * b + 1],
                seq_lens=v32[o + 2 * b + 1 : o + 3 * b + 1],
                kv_indices=v32[at : at + idx.numel()],
                slot_mapping=v64[t * c : t * c + b],
                positions=self.positions,
                page_size=self.page_size,
                qo_lens=(1,) * b,
                kv_lens=tuple(kv_lens),
                pages_per_seq=tuple(counts),
                kv_indices_host=kv_indices,
            )
        v32[:used].copy_(h32[:used], non_blocking=True)
        n64 = len(self.windows) * c + b
        v64[:n64].copy_(h64[:n64], non_blocking=True)
        self.input_ids[: md.num_seqs].copy_(input_ids, non_blocking=True)
        full = tables.pop(None)
        if not tables:
            return full
        return dataclasses.replace(full, windows=tuple(tables.items()))  # type: ignore[arg-type]


class DecodeGraphRunner:
    """Runs a paged model's decode steps through CUDA graphs, one per batch size.

    Args:
        model: a ``PagedDecoder`` (anything with ``kv_specs``, ``kernel``, ``allocator``,
            ``attention_layers`` and ``device``).
        fn: what to capture, called as ``fn(input_ids [B], positions [B]) -> logits [B, vocab]``;
            default ``model`` (eager). Pass ``torch.compile(model, backend=kvq_backend)``.
        batch_sizes: sizes to capture; a batch runs in the smallest size that holds it.
        max_context: the longest sequence (tokens, including this step's) a batch may have; it
            sizes the page-table buffers and XQA's grid, so keep it close to the real limit.
        capture: False runs the same fixed-buffer path eagerly (debugging; CPU; any kernel).

    Graphs are captured lazily, on a size's first batch (two warm-up runs, then capture, in a
    shared memory pool). Every kernel must have ``supports_cuda_graphs``; the reference kernel
    does not (use ``capture=False``). After ``model.configure_kv`` the runner refuses to run: its
    graphs hold the old caches. ``close()`` (or leaving ``with runner:``) frees the scratch page
    and the graphs.
    """

    def __init__(
        self,
        model: Any,
        fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        max_context: int,
        capture: bool = True,
    ) -> None:
        sizes = tuple(batch_sizes)
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
            raise ValueError(f"batch_sizes must be positive ints, got {batch_sizes!r}")
        check_positive_int(max_context, "max_context")
        self.model = model
        self.fn = fn if fn is not None else model
        self.batch_sizes = tuple(sorted(set(sizes)))
        self.max_context = max_context
        self.capture = capture
        self.device = torch.device(model.device)
        self._specs = model.kv_specs
        kernels = model.kernel if isinstance(model.kernel, Mapping) else {"*": model.kernel}
        if capture:
            bad = sorted(
                {repr(k) for k in kernels.values() if not getattr(k, "supports_cuda_graphs", False)}
            )
            if bad:
                raise ValueError(
                    f"kernel(s) {bad} cannot be captured in a "
                    "CUDA graph (supports_cuda_graphs is not True); use FlashInferKernel or "
                    "capture=False"
                )
            if self.device.type != "cuda":
                raise ValueError(
                    f"capture=True needs the model on a CUDA device, it is on {self.device}; "
                    "use capture=False to run the fixed-buffer path without graphs"
                )
        alloc = model.allocator
        self.page_size: int = alloc.page_size
        self.max_pages_per_seq = -(-max_context // self.page_size)
        # a windowed table holds at most the pages of `window` tokens at any offset (+1)
        self._windows = windows = tuple(
            (w, min(self.max_pages_per_seq, -(-w // self.page_size) + 1))
            for w in getattr(alloc, "window_pages", {})
        )
        self._widths: dict[int | None, int] = {None: self.max_pages_per_seq, **dict(windows)}
        self.pad_sequence = f"{PAD_SEQUENCE}.{next(_runner_ids)}"
        alloc.append(self.pad_sequence, 1)
        self._allocator = alloc
        self.scratch_pages = {w: alloc.pages(self.pad_sequence, w)[0] for w in self._widths}
        self.scratch_page: int = self.scratch_pages[None]
        self.table_pages: dict[int | None, int] = {}  # the smallest cache reading each table
        for a in model.attention_layers:
            w = a.spec.sliding_window if a.spec.sliding_window in dict(windows) else None
            n = int(a.kv_cache.shape[0])
            self.table_pages[w] = min(n, self.table_pages.get(w, n))
        self._slots: dict[int, _Slot] = {}
        self._pool: Any = None
        self._closed = False

    def close(self) -> None:
        """Free the scratch page and drop the graphs and buffers; later calls raise."""
        if self.pad_sequence in self._allocator.sequences:
            self._allocator.free(self.pad_sequence)
        self._slots.clear()
        self._pool = None
        self._closed = True

    def __enter__(self) -> DecodeGraphRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(b for b, s in self._slots.items() if s.graph is not None))

    def __call__(self, input_ids: torch.Tensor, metadata: BatchMetadata) -> torch.Tensor:
        """input_ids [B] int, ``metadata`` a decode-only batch of B sequences (on any device;
        only its host fields are read) -> logits [B, vocab], a fresh tensor."""
        size = self._check(input_ids, metadata)
        slot = self._slots.get(size)
        if slot is None:
            shape = GraphShape(size, self.max_pages_per_seq, self._windows)
            slot = self._slots[size] = _Slot(shape, self.page_size, self.device)
        with torch.no_grad():
            static_md = slot.fill(metadata, input_ids, self.scratch_pages)  # copy_ casts the ids
            with forward_context(static_md, self._specs, self.model.kernel, graph=slot.shape):
                if slot.copied is not None:
                    slot.copied.record()  # after every host-to-device copy of this step
                if not self.capture:
                    return self.fn(slot.input_ids, slot.positions)[: metadata.num_seqs].clone()
                if slot.graph is None:
                    self._capture(slot)
                assert slot.graph is not None and slot.output is not None
                slot.graph.replay()
                return slot.output[: metadata.num_seqs].clone()

    def _capture(self, slot: _Slot) -> None:
        """Two warm-up runs on a side stream (compiles, JIT-builds kernels, initialises cuBLAS),
        then capture. The warm-up runs compute this very step, so their cache writes equal the
        replay's."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.fn(slot.input_ids, slot.positions)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            slot.output = self.fn(slot.input_ids, slot.positions)
        slot.graph = graph

    def _check(self, input_ids: torch.Tensor, md: BatchMetadata) -> int:
        """The checks the ops would make while tracing, made per step; returns the slot size."""
        if self._closed:
            raise RuntimeError("this DecodeGraphRunner was closed; build a new one")
        if self.model.kv_specs is not self._specs:
            raise RuntimeError(
                "the model's KV configuration changed (configure_kv) after this DecodeGraphRunner "
                "was built; its graphs hold the old caches. Build a new runner."
            )
        if not isinstance(md, BatchMetadata):
            raise TypeError(f"metadata must be a BatchMetadata, got {type(md).__name__}")
        b = md.num_seqs
        if not md.is_decode_only:
            raise ValueError(
                f"CUDA graphs serve decode-only batches (one new token per sequence); this batch "
                f"has query lengths {sorted(set(md.qo_lens))[:4]}. Run prefill through the model."
            )
        if md.page_size != self.page_size:
            raise ValueError(f"metadata page_size {md.page_size}, expected {self.page_size}")
        if b > self.batch_sizes[-1]:
            raise ValueError(
                f"batch of {b} sequences exceeds the largest captured batch size "
                f"{self.batch_sizes[-1]} (batch_sizes={self.batch_sizes})"
            )
        if input_ids.dim() != 1 or input_ids.shape[0] != b or input_ids.is_floating_point():
            raise ValueError(
                f"input_ids must be a 1-D int tensor of {b} tokens, got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}"
            )
        longest = max(md.kv_lens)
        if longest > self.max_context:
            i = md.kv_lens.index(longest)
            raise ValueError(
                f"sequence {i} of the batch has {longest} tokens, more than max_context "
                f"{self.max_context} this runner was built for"
            )
        for window, scratch in self.scratch_pages.items():
            table = md.for_window(window)
            where = "" if window is None else f" (the page table of window {window})"
            if window is not None and table is md:
                raise ValueError(
                    f"the batch has no page table for window {window}, but the allocator this "
                    "runner was built on has a pool for it; build the batch with that allocator"
                )
            pages = self.table_pages.get(window)
            if pages is not None and table.max_page_id >= pages:
                raise ValueError(
                    f"the batch uses KV page {table.max_page_id}{where} but the caches have "
                    f"{pages} pages; size the PageAllocator to the layers' num_pages"
                )
            if bool((table.kv_indices_host == scratch).any()):
                raise ValueError(
                    f"the batch uses page {scratch}{where}, the runner's scratch page for padding "
                    f"(owned by allocator sequence {self.pad_sequence!r})"
                )
            width = self._widths[window]
            if max(table.pages_per_seq) > width:
                raise ValueError(
                    f"a sequence of the batch has {max(table.pages_per_seq)} pages{where}, more "
                    f"than the {width} this runner was built for"
                )
        return next(s for s in self.batch_sizes if s >= b)
