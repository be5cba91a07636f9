"""Experimental variants of ``torch_kvq.attention.kernels.triton_decode_tma``, built from its
source for measurement before any of them goes into the package.

``vperm``: V's columns permuted so that each thread's mma columns are 16 contiguous cache bytes.
``p @ v`` contracts over tokens; the mma B fragment of lane ``l`` holds column ``l // 4`` of every
8-column block j, which in V's natural order are 8 bytes apart, so Triton gathers V one byte at
a time (128 ``LDS.U8`` per two Llama pages, ``scripts/tma_kernel_sass.py``). Seen as column
``c = j * (D // 16) + r`` <- ``d = r * 16 + j``, lane ``l``'s columns are ``d = 16 * (l // 4) + j``,
one ``LDS.128`` per token row; the output is written back through the inverse map. The products
are the same sums in another order of columns. On sm90 (Triton 3.6, compiled without a GPU):
no ``LDS.U8``, 8 ``LDS.128``, byte permutes (``PRMT`` / ``LOP3``) instead, 242 -> 168 registers
at Llama's tuned config; no shared-memory round trip (the V-through-shared-memory variant of
run 30 had one and ran slower).

    mod = load_variant("vperm", out_dir)   # a module with the same API (paged_decode_tma, TUNED)
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

# (anchor, replacement) pairs applied to the package kernel's source; each anchor must occur once
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "vperm": [
        (
            "    v = kv_desc.load([row + PAGE, col])\n",
            "    v = kv_desc.load([row + PAGE, col])\n"
            "    # vperm: column c = j * (D // 16) + r holds d = r * 16 + j\n"
            "    v = tl.reshape(tl.permute(tl.reshape(v, [PAGE, D // 16, 16]), [0, 2, 1]), [PAGE, D])\n",
        ),
        (
            "    PAGE: tl.constexpr, DOT: tl.constexpr, USE_SOFT_CAP: tl.constexpr,\n):",
            "    PAGE: tl.constexpr, DOT: tl.constexpr, USE_SOFT_CAP: tl.constexpr,\n"
            "    D: tl.constexpr = 128,\n):",
        ),
        ("offs_t, PAGE, DOT, USE_SOFT_CAP,\n", "offs_t, PAGE, DOT, USE_SOFT_CAP, D,\n"),
        (
            "    if DIRECT:\n        o = acc",
            "    offs_d = (offs_d % (D // 16)) * 16 + offs_d // (D // 16)  # vperm: back to d\n"
            "    if DIRECT:\n        o = acc",
        ),
    ],
}
COUNTS = {("vperm", 2): 4}  # the call-site anchor occurs once per page of a 4-page iteration


def variant_source(name: str) -> str:
    """The package kernel's source with variant ``name``'s edits (ValueError if one no longer
    applies: the kernel changed under it)."""
    from torch_kvq.attention.kernels import triton_decode_tma

    src = inspect.getsource(triton_decode_tma)
    for i, (anchor, new) in enumerate(VARIANTS[name]):
        want = COUNTS.get((name, i), 1)
        if src.count(anchor) != want:
            raise ValueError(
                f"variant {name!r}: edit {i} expects its anchor {want} time(s) in "
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
