"""What the TMA decode (``decode_tma.paged_decode_tma``) runs with where its caller does not say:
per page loop (``cache_kind``), head size and page size, the loop's measured configuration
(``TUNED``, ``BY_PAGE``) and the schedule: the split grid's split count, or the balanced schedule
(``BALANCED``). Host logic only (no Triton): the numbers behind each entry are in
docs/design/fp8_decode_paths.md and docs/design/int4-branch.md.
"""

from __future__ import annotations

import math

import torch

# (warps, stages, pages per iteration, lazy rescale, max registers, grid programs per SM) per page
# loop (``cache_kind``) and head size: the fastest measured on an H200 at 16-token pages
# (docs/design/fp8_decode_paths.md; the 4-bit caches: docs/design/int4-branch.md). One warp per
# program beats two and four on both head sizes; the lazy rescale helps at head 128 and not at
# head 256. Head sizes not listed take head 128's. Max registers None: Triton's choice; a cap is
# the one the config compiles spill-free under (scripts/tma_kernel_sass.py), measured faster for
# the programs it adds per SM. Grid programs per SM: what the split grid aims at
# (``default_num_splits``) when the caller gives no schedule; deep pipelines over fewer, longer
# programs measured faster for k8v4 (at head 128 it slows to half with ~16 programs per SM, at
# any batch) and for int4 at head 256, while int4 at head 128 measured faster with more programs
# at small batches (not through a register cap: docs/design/int4-branch.md). The 4-bit entries
# at head 128 are the targets that pick the fastest split count measured at 32, 80 and 197
# sequences.
TUNED = {
    "codes": {128: (1, 6, 1, True, None, 8), 256: (1, 6, 1, False, None, 8)},
    "int4": {128: (1, 6, 1, True, None, 10), 256: (1, 6, 2, False, None, 4)},
    "k8v4": {128: (1, 6, 1, True, None, 6), 256: (1, 6, 1, False, None, 4)},
}
# Entries measured faster than ``TUNED``'s at other page sizes (tokens a page), per (page loop,
# head size, page): at 32 x 16k, int4 at head 256 with 32-token pages ran at half speed over two
# pages an iteration; k8v4 with 6 stages of 64-token pages at head 128 (and of 32-token ones at
# head 256) ran slower than with 4 (docs/design/int4-branch.md). A page size not listed takes
# ``TUNED``'s entry with its pages per iteration cut to cover no more tokens than at 16-token
# pages (at least one page).
BY_PAGE = {
    ("int4", 256, 32): (1, 6, 1, False, None, 4),
    ("k8v4", 256, 32): (1, 4, 1, False, None, 4),
    ("k8v4", 128, 64): (1, 4, 1, True, None, 6),
}
# The int4 page loop over two kv heads per program (``int4_pair``) per head size: (warps, stages,
# pages per iteration, lazy rescale, max registers, the fewest and the most programs per SM its
# split grid may hold). It issues fewer instructions per page and kv head than one head per program
# but holds 168 registers, and measured faster only with its grid at 7.25-8 programs per SM (one
# wave; at 5.8 or 8.7 it ran 10-20 points slower), and eager: at 16, 32, 40, 64 and 128
# sequences x 16k at head 128 (docs/design/int4-branch.md, eighteenth session). Head 128 only
# by default (at 256 it spills); other sizes take head 128's entry when asked for explicitly.
PAIRED = {"int4": {128: (1, 6, 1, False, None, 7.25, 8.0)}}
# (programs per SM, max registers) of the balanced schedule (``decode_balanced``) per page loop
# and head size, taken when ``num_splits`` and ``programs_per_sm`` are both None, no workspace is
# given and the split grid would have 1 or 2 splits: there it measured faster for one code per
# element at head 128 (Llama); with more splits, at head 256 at every batch measured, and for the
# 4-bit loops (at 197 sequences x 16k the split grid at 1 split ran twice as fast for int4), the
# split grid is faster.
BALANCED = {"codes": {128: (16, 128)}}


def cache_kind(kv_cache: torch.Tensor) -> str:
    """The page loop that reads ``kv_cache``, ``TUNED``'s key: "int4" (uint8, 2 slots), "k8v4"
    (uint8, 3 slots), else "codes" (one code or value per element: FP8, bf16 / fp16, int8)."""
    if kv_cache.dtype != torch.uint8:
        return "codes"
    return "k8v4" if kv_cache.shape[1] == 3 else "int4"


def mode_cache_kind(mode: str) -> str:
    """``cache_kind`` of a KV mode's cache by the mode's name (e.g. ``"k8v4_per_token_head"``)."""
    return {"int4_per_token_head": "int4", "k8v4_per_token_head": "k8v4"}.get(mode, "codes")


def _entry(head_size: int, kind: str, page: int = 16) -> tuple:
    """The entry for ``kind`` at ``head_size`` and ``page`` tokens a page: ``BY_PAGE``'s, else
    ``TUNED``'s (head 128's where none) with its pages per iteration cut to the tokens of one
    iteration at 16-token pages. ValueError."""
    if kind not in TUNED:
        raise ValueError(f"tuned: cache kind {kind!r}; expected one of {sorted(TUNED)}")
    if (kind, head_size, page) in BY_PAGE:
        return BY_PAGE[kind, head_size, page]
    entry = TUNED[kind].get(head_size, TUNED[kind][128])
    ppi = max(1, entry[2] * 16 // page) if page > 16 else entry[2]
    return (*entry[:2], ppi, *entry[3:])


def tuned(
    head_size: int, kind: str = "codes", paired: bool = False, page: int = 16
) -> dict[str, int | bool | None]:
    """``paged_decode_tma`` keyword arguments measured best for ``head_size`` on a cache of
    ``kind`` (``cache_kind``) with ``page`` tokens a page; ``paired``: for two kv heads per
    program (``PAIRED``, measured at 16-token pages)."""
    entry = _pair_entry(head_size, kind) if paired else _entry(head_size, kind, page)
    warps, stages, ppi, lazy, regs = entry[:5]
    return dict(num_warps=warps, num_stages=stages, pages_per_iter=ppi, lazy_rescale=lazy,
                max_registers=regs)  # fmt: skip


def tuned_grid(head_size: int, kind: str = "codes", page: int = 16) -> int:
    """The programs per SM the split grid aims at for ``kind`` at ``head_size`` and ``page``."""
    return _entry(head_size, kind, page)[5]


def _pair_entry(head_size: int, kind: str) -> tuple:
    """``PAIRED``'s entry for ``kind`` at ``head_size`` (head 128's where none). ValueError."""
    if kind not in PAIRED:
        raise ValueError(f"paired: cache kind {kind!r}; expected one of {sorted(PAIRED)}")
    return PAIRED[kind].get(head_size, PAIRED[kind][128])


def paired_splits(
    batch: int, kv_heads: int, max_seq_len: int, page: int, head_size: int, sms: int, kind: str
) -> tuple[int, bool]:
    """(splits per (sequence, kv-head pair) of the two-kv-heads-per-program grid, whether the
    default schedule takes that grid): the most splits (each keeping at least 64 pages, at
    least 1) that hold at most ``PAIRED``'s most programs per SM; taken where ``PAIRED`` lists
    ``head_size`` for ``kind`` and the grid then holds at least its fewest (no power-of-two
    rounding: only that narrow range measured fast). ``kv_heads`` even. ValueError."""
    if kv_heads % 2:
        raise ValueError(f"paired_splits: kv_heads={kv_heads} must be even")
    fewest, most_per_sm = _pair_entry(head_size, kind)[5:]
    per_split = batch * kv_heads // 2
    splits = max(1, min(int(most_per_sm * sms) // per_split, _most_splits(max_seq_len, page)))
    taken = head_size in PAIRED[kind] and splits * per_split >= fewest * sms
    return splits, taken


def resolve_config(
    head_size: int,
    kind: str = "codes",
    paired: bool = False,
    page: int = 16,
    **given: int | bool | None,
) -> dict[str, int | bool | None]:
    """``tuned(head_size, kind, paired, page)`` with each argument ``given`` as not None in its
    place; its register cap only with the rest of its config (a cap is what one config compiles
    spill-free under, not a setting of its own)."""
    best = tuned(head_size, kind, paired, page)
    given = {k: v for k, v in given.items() if v is not None}
    cfg = {**best, **given}
    if "max_registers" not in given and any(cfg[k] != best[k] for k in given):
        cfg["max_registers"] = None
    return cfg


def balanced_registers(
    head_size: int,
    cfg: dict[str, int | bool | None],
    cap: int | None,
    kind: str = "codes",
    page: int = 16,
) -> int | None:
    """The register cap for the balanced schedule chosen by ``BALANCED``: its ``cap`` only at
    ``tuned(head_size, kind, page=page)``, the configuration measured (and compiled spill-free)
    under it; None (Triton's choice) for any other. Under the cap, other configurations can
    spill registers (scripts/tma_kernel_sass.py) and run several times slower."""
    return cap if cfg == tuned(head_size, kind, page=page) else None


def default_num_splits(
    batch: int, kv_heads: int, max_seq_len: int, page: int, sms: int, programs_per_sm: int = 8
) -> int:
    """Splits per (sequence, kv head): the power of two at or above ``programs_per_sm`` programs
    per SM, each split keeping at least 64 pages (a power of two packs the grid into whole waves;
    fewer, odd counts measured slower)."""
    want = 1 << max(0, math.ceil(math.log2(programs_per_sm * sms / (batch * kv_heads))))
    return max(1, min(want, _most_splits(max_seq_len, page)))


def _most_splits(max_seq_len: int, page: int) -> int:
    """The most splits per (sequence, kv head) a grid takes: each keeps at least 64 pages, and
    at most 64 of them."""
    return max(1, min(-(-max_seq_len // (64 * page)), 64))


def default_schedule(
    batch: int,
    kv_heads: int,
    max_seq_len: int,
    page: int,
    head_size: int,
    sms: int,
    kind: str = "codes",
) -> tuple[int, tuple[int, int] | None]:
    """(the split grid's split count, the balanced schedule's (programs per SM, max registers)
    where ``BALANCED`` has an entry for ``kind`` at ``head_size`` and the grid would have 1 or 2
    splits at 8 programs per SM, else None). Without the balanced schedule the grid aims at
    ``kind``'s tuned programs per SM."""
    splits = default_num_splits(batch, kv_heads, max_seq_len, page, sms)
    balanced = BALANCED.get(kind, {}).get(head_size)
    if splits <= 2 and balanced is not None:
        return splits, balanced
    grid = tuned_grid(head_size, kind, page)
    return default_num_splits(batch, kv_heads, max_seq_len, page, sms, grid), None


def sm_count(device: torch.device) -> int:
    """The device's SM count (torch caches the properties); 132 (an H200) off CUDA, where the
    interpreter runs the schedules a GPU would."""
    return (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 132
    )
