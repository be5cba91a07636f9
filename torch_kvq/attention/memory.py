"""KV-cache memory that follows the per-layer spec: page pools per cache group, bytes, capacity.

A layer's cache holds ``pages x page_bytes(spec)`` bytes (codes and scales): FP8 layers half of
bf16 ones, 8-bit per-(token, head) layers a little more than half, and with
windowed pools (``window_pages``, see allocator.py) a sliding-window layer only about ``window``
tokens per sequence instead of the whole context. ``plan_kv_memory`` sizes the pools for a number
of sequences at a context length; ``max_seqs_for_budget`` finds how many fit in a byte budget.

    plan = plan_kv_memory(model.kv_specs, max_seqs=32, max_context=16384)
    model = build_model(..., num_pages=plan.num_pages, window_pages=plan.window_pages)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch_kvq.spec import LayerKVSpec, check_positive_int

WindowPages = int | Mapping[int, int] | None


def page_bytes(spec: LayerKVSpec) -> int:
    """Bytes of one page of the layer's cache: K and V, ``page_size`` tokens, all its KV heads,
    codes plus the per-(token, head) scales (``kv_scale``) of the modes that have them."""
    return spec.page_size * spec.cache_bytes_per_token


def window_pools(specs: Sequence[LayerKVSpec], window_pages: WindowPages) -> dict[int, int]:
    """``{window: pages}`` for the sliding windows of ``specs`` that get a pool of their own.

    ``window_pages``: None (no windowed pools: every layer reads the full table), an int (that
    many pages for every window's pool) or a mapping ``{window: pages}`` naming windows of the
    model. Anything else is a ValueError naming the value.
    """
    windows = sorted({s.sliding_window for s in specs if s.sliding_window is not None})
    if window_pages is None:
        return {}
    if isinstance(window_pages, Mapping):
        unknown = sorted(set(window_pages) - set(windows))
        if unknown:
            raise ValueError(
                f"window_pages names windows {unknown} that no layer has; the model's sliding "
                f"windows are {windows}"
            )
        for w, n in window_pages.items():
            check_positive_int(n, f"window_pages[{w}]")
        return dict(sorted(window_pages.items()))
    check_positive_int(window_pages, "window_pages")
    return {w: window_pages for w in windows}


def layer_pages(spec: LayerKVSpec, num_pages: int, pools: Mapping[int, int]) -> int:
    """Pages of the layer's cache: its window's pool if it has one, else ``num_pages``."""
    if spec.sliding_window is not None and spec.sliding_window in pools:
        return pools[spec.sliding_window]
    return num_pages


def kv_cache_bytes(
    specs: Sequence[LayerKVSpec], num_pages: int, window_pages: WindowPages = None
) -> int:
    """Bytes of every layer's cache for these pool sizes (what the model allocates)."""
    pools = window_pools(specs, window_pages)
    return sum(layer_pages(s, num_pages, pools) * page_bytes(s) for s in specs)


def ideal_kv_bytes(specs: Sequence[LayerKVSpec], seqs: int, context: int) -> int:
    """The bytes attention can still read: ``seqs`` sequences of ``context`` tokens, a sliding
    layer's last ``window`` tokens only, no page rounding."""
    total = 0
    for s in specs:
        tokens = context if s.sliding_window is None else min(context, s.sliding_window)
        total += seqs * tokens * page_bytes(s) // s.page_size
    return total


@dataclass(frozen=True)
class KVMemoryPlan:
    """Pool sizes for ``max_seqs`` sequences of up to ``max_context`` tokens, and their bytes."""

    num_pages: int
    window_pages: dict[int, int]
    max_seqs: int
    max_context: int
    bytes: int
    ideal_bytes: int

    @property
    def overhead(self) -> float:
        """Allocated bytes over the ideal, minus one (0.02 = 2% more than attention can read)."""
        return self.bytes / self.ideal_bytes - 1


def plan_kv_memory(
    specs: Sequence[LayerKVSpec],
    max_seqs: int,
    max_context: int,
    *,
    windowed: bool = True,
    prefill_chunk: int = 0,
    reserve_pages: int = 1,
) -> KVMemoryPlan:
    """Pool sizes for ``max_seqs`` sequences of up to ``max_context`` tokens each.

    The full pool: ``ceil(max_context / page)`` pages per sequence. With ``windowed`` each
    sliding window gets its own pool: a decode step keeps at most ``ceil(window / page) + 1``
    pages per sequence; a prefill step of ``n`` tokens transiently needs ``ceil(n / page)`` more
    for its sequence, so give the longest prefill chunk (one sequence at a time) as
    ``prefill_chunk`` (0: the sequences were filled in steps of at most one page). Every pool
    keeps ``reserve_pages`` more (a ``DecodeGraphRunner`` takes one scratch page per pool).
    """
    check_positive_int(max_seqs, "max_seqs")
    check_positive_int(max_context, "max_context")
    if not specs:
        raise ValueError("plan_kv_memory needs the specs of at least one layer")
    page = specs[0].page_size
    num_pages = max_seqs * -(-max_context // page) + reserve_pages
    window_pages: dict[int, int] = {}
    if windowed:
        for w in sorted({s.sliding_window for s in specs if s.sliding_window is not None}):
            per_seq = min(-(-max_context // page), -(-w // page) + 1)
            extra = min(-(-prefill_chunk // page), -(-max_context // page))
            window_pages[w] = min(num_pages, max_seqs * per_seq + extra + reserve_pages)
    return KVMemoryPlan(
        num_pages=num_pages,
        window_pages=window_pages,
        max_seqs=max_seqs,
        max_context=max_context,
        bytes=kv_cache_bytes(specs, num_pages, window_pages or None),
        ideal_bytes=ideal_kv_bytes(specs, max_seqs, max_context),
    )


def max_seqs_for_budget(
    specs: Sequence[LayerKVSpec],
    budget_bytes: int,
    max_context: int,
    *,
    windowed: bool = True,
    prefill_chunk: int = 0,
    reserve_pages: int = 1,
) -> KVMemoryPlan:
    """The plan with the most sequences of ``max_context`` tokens whose caches fit in
    ``budget_bytes``; ValueError naming the budget if not even one sequence fits."""
    check_positive_int(budget_bytes, "budget_bytes")

    def plan(n: int) -> KVMemoryPlan:
        return plan_kv_memory(
            specs, n, max_context, windowed=windowed, prefill_chunk=prefill_chunk,
            reserve_pages=reserve_pages,
        )  # fmt: skip

    if plan(1).bytes > budget_bytes:
        raise ValueError(
            f"a KV budget of {budget_bytes} bytes does not hold one sequence of {max_context} "
            f"tokens (that needs {plan(1).bytes} bytes)"
        )
    lo, hi = 1, 2
    while plan(hi).bytes <= budget_bytes:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # bytes grow with the sequence count
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(mid).bytes <= budget_bytes else (lo, mid)
    return plan(lo)
