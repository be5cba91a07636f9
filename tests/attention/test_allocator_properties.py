"""PageAllocator under a random workload (hypothesis state machine), with real Attention layers.

Rules: a batch of new tokens for old and new sequences (prefill, decode, or both), freeing a
sequence, reusing freed pages, and batches too large for the free pages. After every step:
no page is owned twice, free + owned pages are all pages, each sequence's length and page count
match the model; and, through two real ``Attention`` layers (a sliding-window model-dtype layer and
a global FP8 layer) with the reference kernel, each sequence's cache pages hold exactly the k/v it
wrote and its attention output equals dense attention over its own history only, so no sequence
ever reads another's pages (freed pages still hold the previous owner's values). An
``OutOfPagesError`` changes nothing: page tables, lengths, free count and cache bytes.
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
from torch_kvq.attention.kernels.base import quantize_fp8
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig, resolve_layer_specs

NUM_PAGES, PAGE, HEADS, KV_HEADS, D, WINDOW = 10, 4, 4, 2, 8, 5
K_SCALE, V_SCALE = 0.02, 0.03
_uid = itertools.count()


class AllocatorMachine(RuleBasedStateMachine):
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
        self.layers = [Attention(s, NUM_PAGES) for s in self.specs]
        self.alloc = PageAllocator(NUM_PAGES, PAGE)
        self.hist: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq -> (k, v) [L, KH, D]
        self.next_id = 0
        self.gen = torch.Generator().manual_seed(0)

    # --- helpers -------------------------------------------------------------------------------

    def snapshot(self) -> tuple:
        tables = {s: (self.alloc.pages(s), self.alloc.seq_len(s)) for s in self.alloc.sequences}
        caches = [a.kv_cache.view(torch.uint8).clone() for a in self.layers]
        return tables, self.alloc.num_free_pages, caches

    def pages_needed(self, requests: list[tuple[int, int]]) -> int:
        need = 0
        for sid, n in requests:
            have = self.alloc.pages(sid) if sid in self.hist else ()
            total = (self.alloc.seq_len(sid) if sid in self.hist else 0) + n
            need += max(0, -(-total // PAGE) - len(have))
        return need

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
        if self.pages_needed(requests) > self.alloc.num_free_pages:
            return self.refuse(requests)
        md = self.alloc.build_batch(requests)
        # the batch's page table is the allocator's (its per-sequence tensors are extended in place)
        assert md.page_tables == tuple(self.alloc.pages(sid) for sid, _ in requests)
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
        too_many = (self.alloc.num_free_pages + 1) * PAGE
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
        """Take every free page for one new sequence: they are exactly the unowned pages."""
        free = self.alloc.num_free_pages
        if not free:
            return
        sid = -1 - self.next_id
        self.next_id += 1
        self.alloc.append(sid, free * PAGE)
        owned = {p for s in self.hist for p in self.alloc.pages(s)}
        assert set(self.alloc.pages(sid)) == set(range(NUM_PAGES)) - owned
        assert self.alloc.num_free_pages == 0
        self.alloc.free(sid)
        assert self.alloc.num_free_pages == free

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def pages_partition(self) -> None:
        assert set(self.alloc.sequences) == set(self.hist)
        owned = [p for s in self.alloc.sequences for p in self.alloc.pages(s)]
        assert len(owned) == len(set(owned)), f"a page is owned twice: {sorted(owned)}"
        assert all(0 <= p < NUM_PAGES for p in owned)
        assert len(owned) + self.alloc.num_free_pages == NUM_PAGES

    @invariant()
    def lengths_and_cache_contents(self) -> None:
        for sid, (kh, vh) in self.hist.items():
            n = kh.shape[0]
            pages = self.alloc.pages(sid)
            assert self.alloc.seq_len(sid) == n and len(pages) == -(-n // PAGE)
            for spec, layer in zip(self.specs, self.layers):
                ctx = layer.kv_cache[list(pages)]  # [n_pages, 2, PAGE, KH, D]
                got_k = ctx[:, 0].reshape(-1, KV_HEADS, D)[:n]
                got_v = ctx[:, 1].reshape(-1, KV_HEADS, D)[:n]
                want_k, want_v = kh, vh
                if spec.is_quantized:
                    got_k, got_v = got_k.view(torch.uint8), got_v.view(torch.uint8)
                    want_k = quantize_fp8(kh, K_SCALE).view(torch.uint8)
                    want_v = quantize_fp8(vh, V_SCALE).view(torch.uint8)
                assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), f"seq {sid}"


AllocatorMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,  # the default run is reproducible in CI; the slow run explores
    suppress_health_check=[HealthCheck.too_slow],
)
test_allocator_workload = AllocatorMachine.TestCase


@pytest.mark.slow
def test_allocator_workload_long() -> None:
    """The same machine, many more and longer runs (``-m slow``)."""
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        AllocatorMachine,
        settings=settings(max_examples=300, stateful_step_count=40, deadline=None),
    )
