"""Which kernel serves which layers where: the one table that the kernels' own support checks
(``FlashInferKernel.check_supported``) and the fusion passes (``make_stamp``) both read.

Each kernel name has one ``ArchRow`` per device arch (``"cpu"``, ``"sm90"``, ..., or ``"*"`` for
any arch). A row holds:

- ``combos``: the ``(quant mode, q dtype, fp8 output)`` combinations the kernel runs.
  ``(NONE, bf16, False)``: attention over a bf16 cache with a bf16 query;
  ``(FP8_PER_TENSOR, bf16, False)``: it reads an FP8 paged cache in place with a bf16 query (so
  quant+write and dequant+attention may be fused for such a layer); likewise
  ``(INT8_PER_TOKEN_HEAD, bf16, False)`` / ``(FP8_PER_TOKEN_HEAD, bf16, False)`` /
  ``(INT4_PER_TOKEN_HEAD, bf16, False)``: it reads the codes and their per-(token, head)
  ``kv_scale`` in place;
  ``(FP8_PER_TENSOR, bf16, True)``: it also writes FP8 output through ``output_scale`` (so a static
  FP8 quant of the attention output may be fused). Claim this only where the kernel really writes
  FP8 output for every batch shape the compiled graph serves (prefill and decode).
- ``head_sizes``: the head sizes it runs (None: any);
- ``fp8_page_sizes`` / ``fp8_soft_cap``: limits on FP8 per-tensor layers only (XQA's page sizes,
  and no logit soft-cap), None / True for none; ``per_token_head_page_sizes`` the page sizes of
  per-(token, head) layers (the Triton decode's), None for any.
- ``tensor_output_scale``: where the row claims FP8 output, the kernel also takes the output scale
  as a device tensor read at run time (a 0-d / 1-element float32 buffer or parameter), not only as
  a Python float (so a static FP8 quant whose scale is such a tensor may be fused). The reference
  kernel does; FlashInfer's XQA does not (its ``o_scale`` is a float).

``(INT8_PER_TOKEN_HEAD, bf16, False)`` / ``(FP8_PER_TOKEN_HEAD, bf16, False)`` /
``(INT4_PER_TOKEN_HEAD, bf16, False)`` / ``(K8V4_PER_TOKEN_HEAD, bf16, False)``: it reads int8 /
e4m3 codes, or int4 ones two per byte, or k int8 and v int4, with their per-(token, head) scales
(``kv_scale``) in place.
A kernel serves a layer when its row has ``(layer mode, model dtype, False)`` and the layer is
within the row's limits: ``unsupported_reason`` says why not. An arch with no row (and no ``"*"``
row) is a ``ValueError`` naming the arch and the archs the kernel has rows for, in the kernel's
check (``KernelUnsupportedError``) and at compile time alike: a kernel is never assumed to run on
an arch nobody checked. Add rows with ``register_capabilities``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import product

import torch

from torch_kvq.spec import MODEL_DTYPES, LayerKVSpec
from torch_kvq.spec_modes import KVQuantMode

Combo = tuple[KVQuantMode, torch.dtype, bool]  # (quant mode, q dtype, fp8 output)

ANY_ARCH = "*"


@dataclass(frozen=True)
class ArchRow:
    """What one kernel runs on one arch (see the module docstring)."""

    combos: frozenset[Combo]
    head_sizes: frozenset[int] | None = None  # None: any head size
    fp8_page_sizes: frozenset[int] | None = None  # page sizes of FP8 per-tensor layers; None: any
    fp8_soft_cap: bool = True  # FP8 per-tensor layers may have a logit soft-cap
    tensor_output_scale: bool = False  # FP8 output with a run-time tensor scale, too
    per_token_head_page_sizes: frozenset[int] | None = None  # of per-(token, head) layers


_TABLE: dict[str, dict[str, ArchRow]] = {
    "reference": {  # every mode; FP8 output where its attention op has an output scale
        ANY_ARCH: ArchRow(
            frozenset(
                (mode, q, fp8_out)
                for mode, q, fp8_out in product(KVQuantMode, MODEL_DTYPES, (False, True))
                if not (fp8_out and mode.has_kv_scale)
            ),
            tensor_output_scale=True,
        )
    },
}


def _sizes(what: str, kernel: str, arch: str, sizes: Iterable[int] | None) -> frozenset[int] | None:
    if sizes is None:
        return None
    out = frozenset(sizes) if not isinstance(sizes, (str, bytes)) else frozenset()
    if not out or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in out):
        raise ValueError(
            f"{what} of kernel {kernel!r} on {arch!r} must be a non-empty collection of positive "
            f"ints or None, got {sizes!r}"
        )
    return out


def register_capabilities(
    kernel: str,
    arch: str,
    combos: Iterable[Combo],
    *,
    head_sizes: Iterable[int] | None = None,
    fp8_page_sizes: Iterable[int] | None = None,
    fp8_soft_cap: bool = True,
    tensor_output_scale: bool = False,
    per_token_head_page_sizes: Iterable[int] | None = None,
) -> None:
    """Set the row of ``kernel`` on ``arch`` (replacing an existing one)."""
    if not isinstance(kernel, str) or not kernel:
        raise ValueError(f"kernel name must be a non-empty string, got {kernel!r}")
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"arch must be a non-empty string like 'cpu', 'sm90' or '*', got {arch!r}")
    rows = frozenset(combos)
    for combo in rows:
        ok = isinstance(combo, tuple) and len(combo) == 3
        mode, q_dtype, fp8_out = combo if ok else (None, None, None)
        if not (
            isinstance(mode, KVQuantMode) and q_dtype in MODEL_DTYPES and isinstance(fp8_out, bool)
        ):
            raise ValueError(
                f"capability {combo!r} of kernel {kernel!r}: expected (KVQuantMode, q dtype in "
                f"{MODEL_DTYPES}, bool fp8 output)"
            )
    row = ArchRow(
        rows,
        _sizes("head_sizes", kernel, arch, head_sizes),
        _sizes("fp8_page_sizes", kernel, arch, fp8_page_sizes),
        bool(fp8_soft_cap),
        bool(tensor_output_scale),
        _sizes("per_token_head_page_sizes", kernel, arch, per_token_head_page_sizes),
    )
    _TABLE.setdefault(kernel, {})[arch] = row


def known_kernels() -> tuple[str, ...]:
    return tuple(sorted(_TABLE))


def _arch_order(arch: str) -> tuple[int, int, str]:
    m = re.fullmatch(r"sm(\d+)", arch)
    return (0, 0, arch) if arch == "cpu" else (1, int(m[1]), arch) if m else (2, 0, arch)


def known_archs() -> tuple[str, ...]:
    """``"cpu"`` and every arch some kernel has its own row for, in arch order."""
    archs = {a for rows in _TABLE.values() for a in rows if a != ANY_ARCH} | {"cpu"}
    return tuple(sorted(archs, key=_arch_order))


def check_arch(arch: str) -> str:
    """``arch`` if the table knows it (``known_archs``), else a ValueError listing those."""
    if arch not in known_archs():
        raise ValueError(
            f"unknown arch {arch!r}; expected one of {list(known_archs())} (an arch like "
            "'sm90' is the GPU's compute capability, 'cpu' the CPU)"
        )
    return arch


def device_arch(device: torch.device | str) -> str:
    """``"cpu"`` for a CPU device, ``"sm<major><minor>"`` (e.g. ``"sm90"``) for a CUDA device."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        return f"sm{major}{minor}"
    raise ValueError(f"device {dev} unsupported; expected a cpu or cuda device")


def arch_row(kernel: str, arch: str) -> ArchRow:
    """The row of ``kernel`` on ``arch`` (its exact arch row, else its ``"*"`` row)."""
    rows = _TABLE.get(kernel)
    if rows is None:
        raise ValueError(
            f"unknown kernel {kernel!r}; the capability table knows {list(known_kernels())}"
        )
    if arch in rows:
        return rows[arch]
    if ANY_ARCH in rows:
        return rows[ANY_ARCH]
    raise ValueError(
        f"kernel {kernel!r} has no capability row for arch {arch!r}; it has rows for "
        f"{sorted(rows, key=_arch_order)}"
    )


def capabilities(kernel: str, arch: str) -> frozenset[Combo]:
    """The combos ``kernel`` supports on ``arch`` (the exact arch row, else its ``"*"`` row)."""
    return arch_row(kernel, arch).combos


def supports(
    kernel: str, arch: str, mode: KVQuantMode, q_dtype: torch.dtype, fp8_output: bool
) -> bool:
    """True if ``kernel`` on ``arch`` runs ``mode`` caches with ``q_dtype`` queries (and FP8 output)."""
    return (mode, q_dtype, fp8_output) in capabilities(kernel, arch)


def supports_tensor_output_scale(kernel: str, arch: str) -> bool:
    """True if ``kernel`` on ``arch`` takes the FP8 output scale as a run-time tensor (where its
    row claims FP8 output at all; ``supports(..., True)`` says where)."""
    return arch_row(kernel, arch).tensor_output_scale


def _either(items: Iterable[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def layer_limit(kernel: str, arch: str, spec: LayerKVSpec) -> str | None:
    """Why ``spec``'s shape is outside the row's limits (head size; for FP8 per-tensor layers page
    size and soft-cap, for per-(token, head) layers page size), else None."""
    row = arch_row(kernel, arch)
    if row.head_sizes is not None and spec.head_size not in row.head_sizes:
        return (
            f"head size {spec.head_size} is not supported; expected one of "
            f"{tuple(sorted(row.head_sizes))}"
        )
    fp8 = spec.mode is KVQuantMode.FP8_PER_TENSOR
    if fp8 and row.fp8_page_sizes and spec.page_size not in row.fp8_page_sizes:
        return (
            f"page size {spec.page_size} is not supported for FP8 caches; expected one of "
            f"{tuple(sorted(row.fp8_page_sizes))}"
        )
    if fp8 and spec.logits_soft_cap and not row.fp8_soft_cap:
        return "a logit soft-cap is not supported for FP8 caches"
    sizes = row.per_token_head_page_sizes
    if spec.mode.per_token_head and sizes and spec.page_size not in sizes:
        return (
            f"page size {spec.page_size} is not supported for {spec.mode.value} caches; expected "
            f"one of {tuple(sorted(sizes))}"
        )
    return None


def unsupported_reason(kernel: str, arch: str, spec: LayerKVSpec) -> str | None:
    """Why ``kernel`` on ``arch`` cannot serve ``spec``'s layer, else None. ValueError for an
    unknown kernel or an arch the kernel has no row for."""
    combos = [c for c in capabilities(kernel, arch) if not c[2]]
    modes = [m for m in KVQuantMode if any(c[0] is m for c in combos)]
    if spec.mode not in modes:
        return (
            f"quant mode {spec.mode.value!r} is not supported; expected "
            f"{_either(repr(m.value) for m in modes) if modes else 'a row that lists one'}"
        )
    dtypes = [d for d in MODEL_DTYPES if (spec.mode, d, False) in combos]
    if spec.model_dtype not in dtypes:
        names = _either(str(d).removeprefix("torch.") for d in dtypes)
        return f"model dtype {spec.model_dtype} is not supported; expected {names}"
    return layer_limit(kernel, arch, spec)


def default_kernel(arch: str) -> str:
    """For display only (``kvq inspect`` without ``--kernel``); compiles never guess a kernel.
    Reference on CPU; on a GPU the first non-reference kernel with a row for that arch."""
    if arch != "cpu":
        for name in known_kernels():
            if name != "reference" and arch in _TABLE[name]:
                return name
    return "reference"


# -- FlashInfer rows (kernels/flashinfer.py; measured on an H200, see benchmarks/RESULTS.md) -----
# One kernel name per FlashInferKernel configuration, because what the compiled graph may claim
# depends on which batches it serves (``FlashInferKernel.name`` gives the name):
#   "flashinfer"             phases="any",    fp8_decode="tensor_cores"
#   "flashinfer-xqa"         phases="any",    fp8_decode="xqa"
#   "flashinfer-decode"      phases="decode", fp8_decode="tensor_cores"
#   "flashinfer-xqa-decode"  phases="decode", fp8_decode="xqa"
#   "flashinfer-triton"      phases="any",    fp8_decode="triton"
#   "flashinfer-triton-decode" phases="decode", fp8_decode="triton"
# Prefill / mixed batches run fa2 (BatchPrefillWithPagedKVCacheWrapper), which rejects FP8 output,
# so only a decode-only kernel whose FP8 decode is XQA claims FP8 output, and only on sm90 (the
# arch where XQA's FP8-output path was run and checked). fa2 and the tensor-core decode wrapper
# run on sm80+ with head sizes 64 / 128 / 256 and bf16 / fp16 queries; XQA (FP8 caches on the
# "-xqa" configurations) runs on sm90, sm100/103 and sm120/121 (FlashInfer's xqa.py), pages of 16 to
# 128 tokens, no logit soft-cap; on sm8x the "-xqa" configurations serve model-dtype layers only.
# sm90 is the arch we measured; the others are FlashInfer's documented support, not tested here.
# The "-triton" configurations run FP8 caches through our Triton kernel
# (attention/triton/decode_tma.py: bulk tensor copies, Hopper and later), claimed on sm90 only,
# where it was run; elsewhere they serve model-dtype layers only. It takes any head size FlashInfer does, pages of 16 to 128, soft-caps.
# Per-(token, head) layers (int8 / e4m3 / int4 codes, or k int8 and v int4, with fp32 scales; and
# tc4's codes with their side rows, run on an H200 in the thirtieth session and, the decode
# fixed, on an H100 in the thirty-first)
# run on sm90 in every configuration:
# decode on the same Triton kernel with the scales per logit / weight column, prefill and mixed
# batches on FlashInfer's model-dtype prefill over the batch's pages dequantized into a compact
# scratch (kernels/flashinfer.py); bf16 / fp16 q, no FP8 output, pages of 16 to 64 tokens (the
# Triton decode's shared memory at 6 stages and head 256 caps the page).
# No FlashInfer row sets tensor_output_scale: XQA's o_scale is a Python float in FlashInfer
# 0.6.18 (its bmm1/bmm2 scales take tensors, o_scale does not), so a quant whose scale is a tensor
# is left unfused there.
_FI_ARCHS = ("sm80", "sm86", "sm87", "sm89", "sm90", "sm100", "sm103", "sm120", "sm121")
_XQA_ARCHS = ("sm90", "sm100", "sm103", "sm120", "sm121")
_FI_HEAD_SIZES = (64, 128, 256)
_XQA_PAGE_SIZES = (16, 32, 64, 128)
_FI_DTYPES = (torch.bfloat16, torch.float16)
_FI_NONE = frozenset(product((KVQuantMode.NONE,), _FI_DTYPES, (False,)))
_FI_BASE = _FI_NONE | frozenset(product((KVQuantMode.FP8_PER_TENSOR,), _FI_DTYPES, (False,)))
_PTH_MODES = (
    KVQuantMode.INT8_PER_TOKEN_HEAD,
    KVQuantMode.FP8_PER_TOKEN_HEAD,
    KVQuantMode.INT4_PER_TOKEN_HEAD,
    KVQuantMode.K8V4_PER_TOKEN_HEAD,
    KVQuantMode.TC4_PER_TOKEN_HEAD,  # its TMA decode (triton/decode_tc4_tma.py), no soft cap
)
_PTH_PAGE_SIZES = (16, 32, 64)
for _arch in _FI_ARCHS:
    _pth = frozenset(product(_PTH_MODES, _FI_DTYPES, (False,))) if _arch == "sm90" else frozenset()
    _pth_limits = {"per_token_head_page_sizes": _PTH_PAGE_SIZES}
    for _name in ("flashinfer", "flashinfer-decode"):
        register_capabilities(
            _name, _arch, _FI_BASE | _pth, head_sizes=_FI_HEAD_SIZES, **_pth_limits
        )
    _xqa = _arch in _XQA_ARCHS
    _fp8_out = {(KVQuantMode.FP8_PER_TENSOR, torch.bfloat16, True)} if _arch == "sm90" else set()
    for _name, _extra in (("flashinfer-xqa", set()), ("flashinfer-xqa-decode", _fp8_out)):
        register_capabilities(
            _name,
            _arch,
            ((_FI_BASE | _extra) if _xqa else _FI_NONE) | _pth,
            head_sizes=_FI_HEAD_SIZES,
            fp8_page_sizes=_XQA_PAGE_SIZES,
            fp8_soft_cap=False,
            **_pth_limits,
        )
    for _name in ("flashinfer-triton", "flashinfer-triton-decode"):
        register_capabilities(
            _name,
            _arch,
            (_FI_BASE if _arch == "sm90" else _FI_NONE) | _pth,
            head_sizes=_FI_HEAD_SIZES,
            fp8_page_sizes=_XQA_PAGE_SIZES,
            **_pth_limits,
        )
