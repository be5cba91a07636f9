"""Which kernel serves which layers where: the table the fusion passes consult.

Each kernel name maps to rows per device arch (``"cpu"``, ``"sm90"``, ..., or ``"*"`` for any).
A row is the set of ``(quant mode, q dtype, fp8 output)`` combinations the kernel runs:

- ``(FP8_PER_TENSOR, bf16, False)``: it reads an FP8 paged cache in place with a bf16 query
  (so quant+write and dequant+attention may be fused for such a layer);
- ``(FP8_PER_TENSOR, bf16, True)``: it also writes FP8 output through ``output_scale`` (so a
  static FP8 quant of the attention output may be fused). Claim this only where the kernel
  really writes FP8 output for every batch shape the compiled graph serves (prefill and decode).

Other engineers add rows (FlashInfer per GPU arch) with ``register_capabilities``.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import product

import torch

from torch_kvq.spec import KVQuantMode

Combo = tuple[KVQuantMode, torch.dtype, bool]  # (quant mode, q dtype, fp8 output)

MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ANY_ARCH = "*"

_TABLE: dict[str, dict[str, frozenset[Combo]]] = {
    "reference": {ANY_ARCH: frozenset(product(KVQuantMode, MODEL_DTYPES, (False, True)))},
}


def register_capabilities(kernel: str, arch: str, combos: Iterable[Combo]) -> None:
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
    _TABLE.setdefault(kernel, {})[arch] = rows


def known_kernels() -> tuple[str, ...]:
    return tuple(sorted(_TABLE))


def device_arch(device: torch.device | str) -> str:
    """``"cpu"`` for a CPU device, ``"sm<major><minor>"`` (e.g. ``"sm90"``) for a CUDA device."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        return f"sm{major}{minor}"
    raise ValueError(f"device {dev} unsupported; expected a cpu or cuda device")


def capabilities(kernel: str, arch: str) -> frozenset[Combo]:
    """The combos ``kernel`` supports on ``arch`` (the exact arch row, else its ``"*"`` row)."""
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
        f"kernel {kernel!r} has no capability row for arch {arch!r}; it has rows for {sorted(rows)}"
    )


def supports(
    kernel: str, arch: str, mode: KVQuantMode, q_dtype: torch.dtype, fp8_output: bool
) -> bool:
    """True if ``kernel`` on ``arch`` runs ``mode`` caches with ``q_dtype`` queries (and FP8 output)."""
    return (mode, q_dtype, fp8_output) in capabilities(kernel, arch)


def default_kernel(arch: str) -> str:
    """The kernel a layer on ``arch`` uses unless told otherwise: reference on CPU; on a GPU the
    first non-reference kernel with a row for that arch, else reference."""
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
# Prefill / mixed batches run fa2 (BatchPrefillWithPagedKVCacheWrapper), which rejects FP8 output,
# so only a decode-only kernel whose FP8 decode is XQA claims FP8 output, and only on sm90 (the
# arch where XQA's FP8-output path was run and checked). fa2 and the tensor-core decode wrapper
# run on sm80+; the archs below other than sm90 are FlashInfer's documented support, not tested.
_FI_ARCHS = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120")
_FI_BASE = frozenset(
    product(
        (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR), (torch.bfloat16, torch.float16), (False,)
    )
)
for _arch in _FI_ARCHS:
    for _name in ("flashinfer", "flashinfer-decode"):
        register_capabilities(_name, _arch, _FI_BASE)
for _arch in ("sm90", "sm100", "sm120"):  # XQA needs sm90+
    register_capabilities("flashinfer-xqa", _arch, _FI_BASE)
    _fp8_out = {(KVQuantMode.FP8_PER_TENSOR, torch.bfloat16, True)} if _arch == "sm90" else set()
    register_capabilities("flashinfer-xqa-decode", _arch, _FI_BASE | _fp8_out)
