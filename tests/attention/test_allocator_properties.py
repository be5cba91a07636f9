"""PageAllocator under a random workload (hypothesis state machine), with real Attention layers.

Rules: a batch of new tokens for old and new sequences (prefill, decode, or both), freeing a
sequence, reusing freed pages, and batches too large for the free pages. After every step:
no page is owned twice, free + owned pages are all pages, each sequence's length and page count
match the model; and, through two real ``Attention`` layers (a sliding-window model-dtype layer and
a global FP8 layer) with the reference kernel, each sequence's cache pages hold exactly the k/v it
wrote and its attention output equals dense attention over its own history only, so no sequence
ever reads another's pages (freed pages still hold the previous owner's values). An
``OutOfPagesError`` changes nothing: page tables, lengths, free count and cache bytes.

``WindowedAllocatorMachine`` runs the same rules with a pool of its own for the sliding layer
(``window_pages``): its sequences keep only the pages their window can still read, released pages
are reused, and the sliding layer's cache has fewer pages than the global one.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from torch_kvq.attention import (
    Attention,
    OutOfPagesError,
    PageAllocator,
    ReferenceKernel,
    forward_context,
    ref_attention,
)
from torch_kvq.attention.quant import quantize_fp8
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig
from torch_kvq.spec_resolve import resolve_layer_specs

NUM_PAGES, PAGE, HEADS, KV_HEADS, D, WINDOW = 10, 4, 4, 2, 8, 5
WINDOW_POOL = 7  # pages of the sliding layer's own pool (WindowedAllocatorMachine)
K_SCALE, V_SCALE = 0.02, 0.03
_uid = itertools.count()


class AllocatorMachine(RuleBasedStateMachine):
    window_pool: int | None = None  # None: one shared table

    def __init__(self) -> None:
        super().__init__()
        tag = f"alloc{next(_uid)}"
        infos = [
            AttentionLayerInfo(f"{tag}.sliding", HEADS, KV_HEADS, D, sliding_window=WINDOW),
            AttentionLayerInfo(f"{tag}.fp8", HEADS, KV_HEADS, D),
        ]
        cfg = KVCacheConfig(
            "fp8",
            skip_layers=(0,),
            page_size=PAGE,
            default_k_scale=K_SCALE,
            default_v_scale=V_SCALE,
        )
        self.specs = resolve_layer_specs(cfg, infos, torch.float32)
        pools = {} if self.window_pool is None else {WINDOW: self.window_pool}
        self.pools: dict[int | None, int] = {None: NUM_PAGES, **pools}
        self.layers = [
            Attention(s, self.pools[s.sliding_window if pools else None]) for s in self.specs
        ]
        self.alloc = PageAllocator(NUM_PAGES, PAGE, pools)
        self.last_qo: dict[int, int] = {}
        self.hist: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq -> (k, v) [L, KH, D]
        self.next_id = 0
        self.gen = torch.Generator().manual_seed(0)

    # --- helpers -------------------------------------------------------------------------------

    def snapshot(self) -> tuple:
        tables = {
            (s, w): (self.alloc.pages(s, w), self.alloc.seq_len(s))
            for s in self.alloc.sequences
            for w in self.pools
        }
        free = {w: self.alloc.free_pages(w) for w in self.pools}
        caches = [a.kv_cache.view(torch.uint8).clone() for a in self.layers]
        return tables, free, caches

    def fits(self, requests: list[tuple[int, int]]) -> bool:
        """Whether every pool has the pages the batch needs, from the lengths alone: a window
        pool keeps the pages from the one holding position old_len - WINDOW + 1 on."""
        for window in self.pools:
            need = 0
            for sid, n in requests:
                old = self.alloc.seq_len(sid) if sid in self.hist else 0
                before = len(self.alloc.pages(sid, window)) if sid in self.hist else 0
                first = 0 if window is None else max(0, old - window + 1) // PAGE
                gone = 0 if sid not in self.hist else self.alloc.released_pages(sid, window)
                need += -(-(old + n) // PAGE) - max(first, gone) - before
            if need > self.alloc.free_pages(window) and window is not None:
                batch = {sid for sid, _ in requests}
                for sid in set(self.hist) - batch:  # sequences outside the batch are trimmed
                    dead = max(0, self.alloc.seq_len(sid) - window + 1) // PAGE
                    need -= max(0, dead - self.alloc.released_pages(sid, window))
            if need > self.alloc.free_pages(window):
                return False
        return True

    def draw_requests(self, data: st.DataObject, max_new: int) -> list[tuple[int, int]]:
        live = sorted(self.hist)
        old = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=4)) if live else []
        n_new = data.draw(st.integers(0 if old else 1, 2))
        ids = old + list(range(self.next_id, self.next_id + n_new))
        self.next_id += n_new
        ids = data.draw(st.permutations(ids))
        return [(sid, data.draw(st.integers(1, max_new))) for sid in ids]

    # --- rules ---------------------------------------------------------------------------------

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A mixed batch that fits: run both layers and check every sequence's read-back."""
        requests = self.draw_requests(data, max_new=6)
        if not self.fits(requests):
            return self.refuse(requests)
        md = self.alloc.build_batch(requests)
        # the batch's page tables are the allocator's (its per-sequence tensors are extended in place)
        for w in self.pools:
            assert md.for_window(w).page_tables == tuple(
                self.alloc.pages(s, w) for s, _ in requests
            )
        self.last_qo.update(requests)
        t = md.num_tokens
        q = torch.randn(t, HEADS, D, generator=self.gen)
        k = torch.randn(t, KV_HEADS, D, generator=self.gen)
        v = torch.randn(t, KV_HEADS, D, generator=self.gen)
        with forward_context(md, self.specs, ReferenceKernel()):
            outs = [layer(q, k, v) for layer in self.layers]
        start = 0
        for sid, n in requests:
            k0, v0 = self.hist.get(sid, (k[:0], v[:0]))
            self.hist[sid] = (
                torch.cat([k0, k[start : start + n]]),
                torch.cat([v0, v[start : start + n]]),
            )
            kh, vh = self.hist[sid]
            kv_len = kh.shape[0]
            pos = torch.arange(kv_len)
            for spec, out in zip(self.specs, outs):
                if spec.is_quantized:  # the FP8 layer attends over its quantized history
                    kh_, vh_ = (
                        quantize_fp8(kh, K_SCALE).float() * K_SCALE,
                        quantize_fp8(vh, V_SCALE).float() * V_SCALE,
                    )
                else:
                    kh_, vh_ = kh, vh
                want = ref_attention(
                    q[start : start + n],
                    kh_,
                    vh_,
                    pos[kv_len - n :],
                    pos,
                    spec.sm_scale,
                    spec.sliding_window,
                )
                torch.testing.assert_close(out[start : start + n], want, atol=1e-5, rtol=1e-5)
            start += n

    def refuse(self, requests: list[tuple[int, int]]) -> None:
        before = self.snapshot()
        with pytest.raises(OutOfPagesError, match="Nothing was allocated"):
            self.alloc.build_batch(requests)
        after = self.snapshot()
        assert before[:2] == after[:2]
        assert all(torch.equal(a, b) for a, b in zip(before[2], after[2]))

    @rule(data=st.data())
    def exhaust(self, data: st.DataObject) -> None:
        """A batch deliberately larger than the free pages is refused and changes nothing."""
        live = sorted(self.hist)
        sid = data.draw(st.sampled_from(live)) if live else self.next_id
        too_many = (max(self.pools.values()) + 1) * PAGE
        self.refuse([(sid, too_many)])

    @precondition(lambda self: bool(self.hist))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.hist)))
        self.alloc.free(sid)
        del self.hist[sid]
        with pytest.raises(KeyError, match=f"unknown sequence {sid!r}"):
            self.alloc.pages(sid)

    @rule()
    def drain(self) -> None:
        """Take every free page of the tightest pool for one new sequence: they are exactly the
        unowned pages."""
        window = min(self.pools, key=lambda w: self.alloc.free_pages(w))
        free = {w: self.alloc.free_pages(w) for w in self.pools}
        if not free[window]:
            return
        sid = -1 - self.next_id
        self.next_id += 1
        self.alloc.append(sid, free[window] * PAGE)
        owned = {p for s in self.hist for p in self.alloc.pages(s, window)}
        assert set(self.alloc.pages(sid, window)) == set(range(self.pools[window])) - owned
        assert self.alloc.free_pages(window) == 0
        self.alloc.free(sid)
        assert {w: self.alloc.free_pages(w) for w in self.pools} == free

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def pages_partition(self) -> None:
        assert set(self.alloc.sequences) == set(self.hist)
        for window, size in self.pools.items():
            owned = [p for s in self.alloc.sequences for p in self.alloc.pages(s, window)]
            assert len(owned) == len(set(owned)), f"a page is owned twice: {sorted(owned)}"
            assert all(0 <= p < size for p in owned)
            assert len(owned) + self.alloc.free_pages(window) == size

    @invariant()
    def window_keeps_only_what_it_can_read(self) -> None:
        """A window pool keeps every token the next query can read and no page wholly before
        the window of the sequence's last step's first query."""
        if self.window_pool is None:
            return
        for sid in self.hist:
            n, released = self.alloc.seq_len(sid), self.alloc.released_pages(sid, WINDOW)
            first_query = n - self.last_qo[sid]  # of the sequence's last step
            # at least what that step's first query cannot read; at most what the next cannot
            assert max(0, first_query - WINDOW + 1) // PAGE <= released
            assert released <= max(0, n - WINDOW + 1) // PAGE
            assert len(self.alloc.pages(sid, WINDOW)) == -(-n // PAGE) - released

    @invariant()
    def lengths_and_cache_contents(self) -> None:
        for sid, (kh, vh) in self.hist.items():
            n = kh.shape[0]
            assert self.alloc.seq_len(sid) == n and len(self.alloc.pages(sid)) == -(-n // PAGE)
            for spec, layer in zip(self.specs, self.layers):
                window = spec.sliding_window if spec.sliding_window in self.pools else None
                pages = self.alloc.pages(sid, window)
                start = 0 if window is None else self.alloc.released_pages(sid, window) * PAGE
                ctx = layer.kv_cache[list(pages)]  # [n_pages, 2, PAGE, KH, D]
                got_k = ctx[:, 0].reshape(-1, KV_HEADS, D)[: n - start]
                got_v = ctx[:, 1].reshape(-1, KV_HEADS, D)[: n - start]
                want_k, want_v = kh[start:], vh[start:]
                if spec.is_quantized:
                    got_k, got_v = got_k.view(torch.uint8), got_v.view(torch.uint8)
                    want_k = quantize_fp8(want_k, K_SCALE).view(torch.uint8)
                    want_v = quantize_fp8(want_v, V_SCALE).view(torch.uint8)
                assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), f"seq {sid}"


AllocatorMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,  # the default run is reproducible in CI; the slow run explores
    suppress_health_check=[HealthCheck.too_slow],
)
test_allocator_workload = AllocatorMachine.TestCase


class WindowedAllocatorMachine(AllocatorMachine):
    window_pool = WINDOW_POOL


WindowedAllocatorMachine.TestCase.settings = AllocatorMachine.TestCase.settings
test_windowed_allocator_workload = WindowedAllocatorMachine.TestCase


@pytest.mark.slow
def test_allocator_workload_long() -> None:
    """The same machine, many more and longer runs (``-m slow``)."""
    from hypothesis.stateful import run_state_machine_as_test

    for machine in (AllocatorMachine, WindowedAllocatorMachine):
        run_state_machine_as_test(
            machine, settings=settings(max_examples=300, stateful_step_count=40, deadline=None)
        )
