"""Writing a batch's new k/v into a paged cache, quantizing on the way in for FP8 layers.

    kv_cache [pages, 2, page_size, KH, D]   (k at [:, 0], v at [:, 1]; FlashInfer's NHD layout)
    k, v     [T, KH, D]                     slot_mapping [T] int: page * page_size + offset

``write_kv`` is what ``kvq::cache_write`` / ``kvq::quant_cache_write`` call. On a CUDA cache it is
one Triton kernel per layer (``attention/triton/kv_write.py``: one program per token, or per few
tokens for the per-(token, head) modes); on the CPU it is ``write_kv_torch`` (aten: quantize,
page/offset, two index_puts).

Both write the bytes of the unfused form they replace: ``quantize_fp8``, i.e.
``clamp(x.float() / scale, ±448)`` cast to e4m3 with round-to-nearest-even, computed as aten
computes ``x.float() / scale`` (a Python-float divisor) on the cache's device. That is a property
of the torch build and device, so the kernel does not assume it: ``aten_scalar_division(device)``
measures it once per device on probe values and the kernel follows it; a build that matches none
of the known forms is refused (``KernelUnsupportedError``), never approximated. Seen: the CPU
divides correctly rounded (``"div"``); CUDA on torch 2.11.0+cu130 (H200) multiplies by
``float32(1 / scale)`` with the reciprocal taken in float64 (``"rcp"``), not by the fp32
reciprocal of ``float32(scale)`` (``"rcp32"``) that this kernel first assumed: the two differ for
scales such as 0.03 (33.3333321 vs 33.3333359), and one FP8 step apart wherever ``x / scale`` lands
on a rounding tie (``1.5 / 0.03``). Bit-equality with the eager op path is tested on the GPU
(tests/attention/test_kv_write.py).

Tensor scales (``kvq::quant_cache_write_ts``: a 0-d or 1-element float32 tensor, the form a
module buffer takes) follow the unfused ``x.float() / scale_tensor`` the same way, per where the
scale lives. On the cache's device: aten's tensor / tensor division, which on CUDA was measured to
be correctly rounded; ``aten_scalar_division(device, "tensor")`` checks that per device and the
Triton kernel loads the scale from its pointer and divides with ``div_rn`` (no host sync, so CUDA
graphs capture it and replay the buffer's current value); any other measured form is refused. A
0-d CPU tensor with a CUDA cache is what aten treats like a Python scalar: its value (a CPU read,
no device sync) goes the Python-float way, measured as ``"cpu_tensor"`` (note: like the unfused
eager form, a CUDA graph captured then keeps the value it saw at capture). On the CPU the aten path
(``write_kv_torch``) is the unfused expression itself.

The per-(token, head) modes' write (codes and one scale per token and kv head) is
``kernels/kv_write_per_token_head.py``; it divides the way this module measures
(``aten_scalar_division``, ``require_correct_tensor_division``).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch

from torch_kvq.attention.kernels.base import KernelUnsupportedError
from torch_kvq.attention.kernels.launch import f32, next_pow2, triton_program
from torch_kvq.attention.quant import FP8_MAX, quantize_fp8
from torch_kvq.spec_modes import FP8_DTYPE

Scales = tuple[float, float] | tuple[torch.Tensor, torch.Tensor]
ScaleKind = Literal["float", "tensor", "cpu_tensor"]


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: Scales | None = None,
) -> None:
    """Scatter k/v [T, KH, D] into ``kv_cache`` at ``slot_mapping`` [T] slots.

    ``scales`` = (k_scale, v_scale), two floats or two float32 tensors, quantizes model-dtype k/v into an FP8 cache; ``None`` writes
    k/v already in the cache dtype. The device picks the implementation (see the module docstring).
    """
    if kv_cache.is_cuda:
        write_kv_triton(kv_cache, k, v, slot_mapping, scales)
    else:
        write_kv_torch(kv_cache, k, v, slot_mapping, scales)


def write_kv_torch(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: Scales | None = None,
) -> None:
    """``write_kv`` in aten ops (any device): the oracle for the Triton kernel."""
    if scales is not None:
        k, v = quantize_fp8(k, scales[0]), quantize_fp8(v, scales[1])
    pages, offsets = pages_and_offsets(slot_mapping, kv_cache.shape[2])
    kv_cache[pages, 0, offsets] = k
    kv_cache[pages, 1, offsets] = v


def pages_and_offsets(
    slot_mapping: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slots (page * page_size + offset) [T] -> (pages [T], offsets [T])."""
    pages = torch.div(slot_mapping, page_size, rounding_mode="floor")
    return pages, slot_mapping - pages * page_size


ScalarDivision = Literal["div", "rcp", "rcp32"]
# (x, scale) probes: exact quotients (169 / 13, 1.5 / 0.03 = 50, an FP8 tie) and random values,
# with scales where the candidate forms round differently (0.03, 0.0341, 13, 0.3, 123.456).
_PROBE_SCALES = (13.0, 0.03, 0.0341, 0.3, 1.0 / 3.0, 7.7e-3, 123.456)


def scalar_operand(form: ScalarDivision, scale: float) -> float:
    """The fp32 operand of each form: the divisor (``"div"``) or the multiplier: ``float32(1 /
    scale)`` with ``1 / scale`` in float64 (``"rcp"``), or ``float32(1) / float32(scale)`` in fp32
    (``"rcp32"``)."""
    if form == "div":
        return f32(scale)
    if form == "rcp":
        return f32(1.0 / scale)
    return float((torch.tensor(1.0, dtype=torch.float64) / f32(scale)).float())


def _division_candidates(x: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    """fp32 ``x / scale`` in each form, computed on the CPU in float64 and rounded once (exact: a
    quotient of two fp32 values rounds correctly through float64, and an fp32 product is exact)."""
    x64 = x.double()
    return {
        "div": (x64 / scalar_operand("div", scale)).float(),
        "rcp": (x64 * scalar_operand("rcp", scale)).float(),
        "rcp32": (x64 * scalar_operand("rcp32", scale)).float(),
    }


@functools.cache
def aten_scalar_division(device: torch.device, kind: ScaleKind = "float") -> ScalarDivision:
    """How aten computes ``x.float() / scale`` on ``device`` for a ``scale`` that is a Python float
    (``kind="float"``), a 0-d float32 tensor on ``device`` (``"tensor"``) or one on the CPU
    (``"cpu_tensor"``): one of ``_division_candidates``' forms (the first that matches every probe;
    a tensor holds float32(scale), so its candidates start from that value). Measured once per
    device and kind; raises ``KernelUnsupportedError`` if aten matches none of them."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise KernelUnsupportedError(
            f"the cache write's rounding probe for {device} cannot run inside CUDA graph capture; "
            "run one uncaptured step first (DecodeGraphRunner's warm-up runs do)"
        )
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor([169.0, 1.5, -3.0, 48.0]), torch.randn(4096, generator=gen) * 40])
    found = ["div", "rcp", "rcp32"]
    for scale in _PROBE_SCALES:
        if kind != "float":
            scale = f32(scale)
            div = torch.tensor(
                scale, dtype=torch.float32, device=device if kind == "tensor" else "cpu"
            )
        else:
            div = scale
        got = (x.to(device) / div).cpu()
        for form, want in _division_candidates(x, scale).items():
            if form in found and not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                found.remove(form)
    if not found:
        raise KernelUnsupportedError(
            f"aten's x / scale ({kind} scale) on {device} (torch {torch.__version__}) matches none of the forms "
            "the fused FP8 cache write knows (a correctly rounded division, or a multiply by "
            "float32(1 / scale) from float64 or fp32); it cannot reproduce it bit for bit"
        )
    return found[0]  # type: ignore[return-value]


def write_kv_triton(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: Scales | None = None,
) -> None:
    """``write_kv`` as one Triton kernel (CUDA). The cache's last two dims must be dense (k / v are
    copied first when theirs are not). Tensor scales on the cache's device are loaded in the kernel
    (no host sync); CPU tensor scales are read on the host (see the module docstring)."""
    if not _inner_dense(kv_cache):
        raise ValueError(
            f"write_kv_triton: kv_cache has strides {tuple(kv_cache.stride())}; expected its last "
            f"two dims dense (head stride {kv_cache.shape[-1]}, element stride 1)"
        )
    k, v = (x if _inner_dense(x) else x.contiguous() for x in (k, v))
    t, kh, d = k.shape
    if scales is not None and kv_cache.dtype != FP8_DTYPE:
        raise ValueError(f"write_kv_triton: quantizing needs an FP8 cache, got {kv_cache.dtype}")
    kind = _scale_kind(kv_cache, scales)  # checks where tensor scales live (before any work)
    kernel = write_program("kv_write_kernel")
    if t == 0:
        return
    division: ScalarDivision = "div"
    k_op: Any = 1.0
    v_op: Any = 1.0
    if scales is not None:
        division = aten_scalar_division(kv_cache.device, kind)
        if kind == "tensor":  # loaded by the kernel from the device: no host sync
            require_correct_tensor_division(
                kv_cache.device, "the fused cache write with a tensor scale"
            )
            k_op, v_op = (torch.as_tensor(x).reshape(()) for x in scales)
        else:  # a Python float, or a CPU tensor's value (a host read, no device sync)
            k_op, v_op = (scalar_operand(division, float(x)) for x in scales)
    kernel[(t,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k_op,
        v_op,
        k.stride(0),
        v.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.shape[2],
        KH=kh,
        D=d,
        BLOCK=next_pow2(kh * d),
        QUANT=scales is not None,
        DIVIDE=division == "div",
        SCALE_PTR=kind == "tensor",
        FP8_MAX=FP8_MAX,
        num_warps=4 if kh * d <= 2048 else 8,
    )


def _scale_kind(kv_cache: torch.Tensor, scales: Scales | None) -> ScaleKind:
    """``"float"`` for Python-float scales (or none), ``"tensor"`` for tensors on the cache's
    device, ``"cpu_tensor"`` for 0-d tensors on the CPU with a cache elsewhere; else a ValueError."""
    if scales is None or not isinstance(scales[0], torch.Tensor):
        return "float"
    devices = [x.device for x in scales]
    if all(dev == kv_cache.device for dev in devices):
        return "tensor"
    if all(dev.type == "cpu" for dev in devices) and all(x.dim() == 0 for x in scales):
        return "cpu_tensor"
    raise ValueError(
        f"write_kv_triton: k / v scale tensors on {[str(dev) for dev in devices]} of shapes "
        f"{[tuple(x.shape) for x in scales]}; expected both on the cache's device "
        f"({kv_cache.device}), or both 0-d on the CPU (aten takes only a 0-d CPU tensor as a scalar)"
    )


def require_correct_tensor_division(device: torch.device, writer: str) -> None:
    """KernelUnsupportedError unless aten's ``x / scale_tensor`` on ``device`` is correctly
    rounded, the division ``writer`` (a Triton write) performs: else its bytes would differ."""
    division = aten_scalar_division(device, "tensor")
    if division != "div":
        raise KernelUnsupportedError(
            f"aten's x / scale_tensor on {device} (torch {torch.__version__}) is not correctly "
            f"rounded (it matches {division!r}); {writer} divides correctly rounded and would "
            "not write the same bytes"
        )


def write_program(name: str) -> Any:
    """Program ``name`` of ``attention/triton/kv_write.py`` (``launch.triton_program``)."""
    return triton_program("kv_write", name, "the CUDA cache write")


def _inner_dense(x: torch.Tensor) -> bool:
    return x.stride(-1) == 1 and (x.shape[-2] == 1 or x.stride(-2) == x.shape[-1])
