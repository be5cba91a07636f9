"""The stamp: what ``node.meta["kvq"]`` holds (a layer's spec plus its kernel's decisions), and
``make_stamp``, which decides them from the capability table.

``node.meta["kvq"]`` is the only meta key the passes write. Passes read the stamp (and a node's
``target`` / ``args``), never a global cache dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import fx

from torch_kvq.attention.kernels import capabilities as caps
from torch_kvq.spec import LayerKVSpec

META_KEY = "kvq"


def short_dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).replace("torch.", "")
    )


@dataclass(frozen=True)
class KVQStamp:
    """What ``node.meta["kvq"]`` holds: the layer's spec plus the kernel decisions for it.

    ``kv_in_place``: the layer is quantized and its kernel reads its quantized cache (codes, and
    the per-(token, head) scales where its mode has them) in place with a model-dtype query
    (quant+write and dequant+attention may be fused). ``fp8_output``: the kernel
    also writes FP8 output for it (an output quant may be fused). ``fused`` names the fusions
    that produced this node (empty for nodes of the original graph). ``limit``: why the layer is
    outside the kernel's capability row for its shape (head size, ...), else None.
    ``fp8_output_tensor_scale``: the kernel also takes that output scale as a run-time tensor.
    """

    spec: LayerKVSpec
    kernel: str
    arch: str
    kv_in_place: bool
    fp8_output: bool
    fused: tuple[str, ...] = ()
    limit: str | None = None
    fp8_output_tensor_scale: bool = False

    @property
    def layer(self) -> str:
        return self.spec.name

    def kept_reason(self) -> str | None:
        """The decision text for a layer the fusions leave alone on purpose, else None."""
        if self.spec.is_quantized:
            return None
        dtype = short_dtype(self.spec.model_dtype)
        if self.spec.skip_reason:
            return f"kept {dtype} (skipped: {self.spec.skip_reason})"
        return f"kept {dtype} (not quantized: mode {self.spec.mode.value})"

    def kv_block(self) -> str | None:
        """Why quant+write / dequant+attention may not be fused for this layer, or None."""
        kept = self.kept_reason()
        if kept is not None:
            return kept
        if self.limit is not None:
            return f"not fused: kernel {self.kernel!r} on {self.arch} cannot serve it: {self.limit}"
        if not self.kv_in_place:
            return (
                f"not fused: kernel {self.kernel!r} on {self.arch} does not read "
                f"{self.spec.mode.value} caches with {short_dtype(self.spec.model_dtype)} q"
            )
        return None

    def output_block(self, tensor_scale: bool = False) -> str | None:
        """Why an output quant (whose scale is a run-time tensor if ``tensor_scale``) may not be
        fused into this layer's attention, or None."""
        blocked = self.kv_block()
        if blocked is not None:
            return blocked
        if not self.fp8_output:
            return (
                f"not fused: kernel {self.kernel!r} on {self.arch} does not write FP8 output for "
                f"{self.spec.mode.value} with {short_dtype(self.spec.model_dtype)} q"
            )
        if tensor_scale and not self.fp8_output_tensor_scale:
            return (
                f"not fused: the output quant's scale is a tensor, and kernel {self.kernel!r} on "
                f"{self.arch} takes the FP8 output scale only as a Python float"
            )
        return None

    def with_fused(self, what: str) -> KVQStamp:
        return replace(self, fused=(*self.fused, what))


def make_stamp(spec: LayerKVSpec, kernel: str, arch: str) -> KVQStamp:
    """The stamp of one layer: its spec plus what its kernel on ``arch`` can do for it, from the
    capability table the kernel's own ``check_supported`` reads (ValueError: unknown kernel, or
    an arch it has no row for)."""
    q = spec.model_dtype
    limit = caps.layer_limit(kernel, arch, spec)
    kv_in_place = (
        spec.is_quantized and limit is None and caps.supports(kernel, arch, spec.mode, q, False)
    )
    fp8_out = kv_in_place and caps.supports(kernel, arch, spec.mode, q, True)
    fp8_out_t = fp8_out and caps.supports_tensor_output_scale(kernel, arch)
    return KVQStamp(
        spec,
        kernel,
        arch,
        kv_in_place=kv_in_place,
        fp8_output=fp8_out,
        limit=limit,
        fp8_output_tensor_scale=fp8_out_t,
    )


def get_stamp(node: fx.Node) -> KVQStamp | None:
    stamp = node.meta.get(META_KEY)
    return stamp if isinstance(stamp, KVQStamp) else None
