"""Variants of ``torch_kvq.attention.kernels.triton_decode_tma``, built from its source by
checked text edits, to measure a change against the package kernel in one run (or to try one
before it goes into the package).

``natural``: V's columns in the cache's order, as the kernel was before run 34. ``p @ v``
contracts over tokens; the mma B fragment of lane ``l`` holds column ``l // 4`` of every 8-column
block, which in V's natural order are 8 bytes apart, so Triton gathers V one byte at a time (128
``LDS.U8`` per two Llama pages, ``scripts/tma_kernel_sass.py --variant natural``). The package
kernel permutes V's columns (``_page_logits``) so that each lane's columns are 16 contiguous
bytes, one ``LDS.128`` per token row (242 -> 168 registers at Llama's tuned config; Llama
88 -> 93% of copy bandwidth at 32 x 16k, run 34 of 2026-12-01).

    mod = load_variant("natural", out_dir)   # a module with the same API (paged_decode_tma, TUNED)
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

# (anchor, replacement) pairs applied to the package kernel's source; each anchor must occur once
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "natural": [
        (
            "    v = tl.reshape(tl.permute(tl.reshape(v, [PAGE, D // 16, 16]), [0, 2, 1]), [PAGE, D])\n",
            "",
        ),
        ("    offs_d = (offs_d % (D // 16)) * 16 + offs_d // (D // 16)\n", ""),
    ],
}


def variant_source(name: str) -> str:
    """The package kernel's source with variant ``name``'s edits (ValueError if one no longer
    applies: the kernel changed under it)."""
    from torch_kvq.attention.triton import decode_tma as triton_decode_tma

    src = inspect.getsource(triton_decode_tma)
    for i, (anchor, new) in enumerate(VARIANTS[name]):
        if src.count(anchor) != 1:
            raise ValueError(
                f"variant {name!r}: edit {i} expects its anchor 1 time(s) in "
                f"triton_decode_tma.py, found {src.count(anchor)}: {anchor[:60]!r}"
            )
        src = src.replace(anchor, new)
    return src


def load_variant(name: str, out_dir: Path) -> ModuleType:
    """Write the variant to ``out_dir/triton_decode_tma_<name>.py`` (Triton reads a kernel's
    source from its file) and import it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"triton_decode_tma_{name}.py"
    path.write_text(variant_source(name))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod
