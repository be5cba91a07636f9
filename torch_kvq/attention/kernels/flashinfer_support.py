"""What a ``FlashInferKernel`` configuration serves, and the checks of the cache it is handed.

``unsupported_reason`` is the capability table's answer (kernels/capabilities.py) for the
configuration's name on the GPU's arch, plus the limits of the kernels behind it that the table
does not spell out (fa3's FP8 prefill and the tc4 decode program: soft-cap, page sizes; Triton
installed; fa3 on sm90 only). ``check_kv_scale`` checks that a per-(token, head) layer's codes
come with their scales and nothing else does.
"""

from __future__ import annotations

import importlib.util

import torch

from torch_kvq.attention.kernels import capabilities as caps
from torch_kvq.spec import LayerKVSpec


def unsupported_reason(
    name: str, arch: str, spec: LayerKVSpec, prefill: str, phases: str, fp8_decode: str
) -> str | None:
    """Why configuration ``name`` (with its ``prefill``, ``phases`` and ``fp8_decode``) cannot
    serve ``spec`` on ``arch``, or None; an arch without a row is refused, naming the archs that
    have one."""
    try:
        why = caps.unsupported_reason(name, arch, spec)
    except ValueError as e:  # no row for this arch
        return str(e)
    if why is None:
        return _kernel_limit(arch, spec, prefill, phases, fp8_decode)
    if fp8_decode != "tensor_cores" and spec.is_quantized:
        plain = name.replace(f"-{fp8_decode}", "")
        if caps.unsupported_reason(plain, arch, spec) is None:
            why += f"; FlashInferKernel(fp8_decode='tensor_cores', phases={phases!r}) serves it"
    return f"{why} (capability row {name!r} on {arch})"


def _kernel_limit(
    arch: str, spec: LayerKVSpec, prefill: str, phases: str, fp8_decode: str
) -> str | None:
    """The limits of the kernels behind a configuration that its capability row allows."""
    if prefill == "fa3_fp8" and spec.is_quantized and spec.logits_soft_cap and phases == "any":
        return (
            "a logit soft-cap is not supported by fa3's FP8 prefill kernel (prefill='fa3_fp8'); "
            "FlashInferKernel(prefill='fa3') serves it (FP8 layers on fa2)"
        )
    if spec.mode.transform_coded and spec.logits_soft_cap:
        return (
            "a logit soft-cap is not supported by the tc4 decode program (triton/decode_tc4_tma.py); "
            "the reference kernel serves such a layer"
        )
    if spec.mode.transform_coded and spec.page_size not in (16, 32, 64):
        return (
            f"pages of {spec.page_size} tokens are not supported by the tc4 decode program "
            "(triton/decode_tc4_tma.py: 16, 32 or 64); the reference kernel serves such a layer"
        )
    triton = fp8_decode == "triton" and spec.is_quantized
    codes = spec.mode.has_kv_scale
    if (triton or codes) and importlib.util.find_spec("triton") is None:
        what = f"a {spec.mode.value} layer" if codes else "fp8_decode='triton'"
        return f"{what} needs Triton (pip install triton), which is not installed"
    if prefill != "fa2" and arch != "sm90":
        return (
            f"prefill={prefill!r} runs FlashInfer's fa3 kernels, which are built for sm90 "
            f"only, and this GPU is {arch}; FlashInferKernel(prefill='fa2') serves it"
        )
    return None


def check_kv_scale(
    spec: LayerKVSpec,
    kv_cache: torch.Tensor,
    kv_scale: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
) -> None:
    """A per-(token, head) layer's codes come with their ``kv_scale`` and per-tensor scales of
    1.0; every other cache without one (ValueError naming the layer)."""
    codes = spec.mode.has_kv_scale and kv_cache.dtype == spec.storage_dtype
    if codes and kv_scale is None:
        raise ValueError(
            f"layer {spec.name!r} ({spec.mode.value}): its {kv_cache.dtype} codes need their "
            "per-(token, head) scales, but kv_scale is None"
        )
    if codes and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError(
            f"layer {spec.name!r} ({spec.mode.value}): k_scale={k_scale!r}, v_scale={v_scale!r}; "
            "its scales are per (token, head) (kv_scale), so the per-tensor ones must be 1.0"
        )
    if not codes and kv_scale is not None:
        raise ValueError(
            f"layer {spec.name!r} ({spec.mode.value}): kv_scale given with a {kv_cache.dtype} "
            f"cache; only a per-(token, head) layer's codes ({spec.storage_dtype}) have one"
        )
