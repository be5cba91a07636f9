"""The attention-kernel interface the ``kvq::*`` ops dispatch to.

A kernel plans once per batch (outside the graph) and then serves the ops of the layers it was
planned for. Which kernel serves a layer, with which query and output dtype, is decided from the
layer's ``LayerKVSpec`` and the capability table, never from a global cache dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from torch_kvq.spec import LayerKVSpec

if TYPE_CHECKING:
    from torch_kvq.attention.context import ForwardContext


class KernelUnsupportedError(RuntimeError):
    """A kernel was asked to serve a layer (or device) it cannot serve. We never fall back."""


@runtime_checkable
class AttentionKernel(Protocol):
    """What the ops call; ``name`` is the kernel's key in the capability table (capabilities.py)."""

    name: str
    # True if, planned with ``ctx.graph`` set, every device tensor ``attend`` reads lives in a
    # buffer that the next plan for the same shape refills in place (so a CUDA graph can replay).
    supports_cuda_graphs: bool

    def check_supported(self, spec: LayerKVSpec) -> None:
        """Raise ``KernelUnsupportedError`` naming the layer and the reason if it cannot serve."""

    def plan(self, ctx: ForwardContext, specs: list[LayerKVSpec]) -> None:
        """Prepare for the batch in ``ctx.metadata`` (called once per forward context)."""

    def attend(
        self,
        ctx: ForwardContext,
        spec: LayerKVSpec,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        k_scale: float,
        v_scale: float,
        output_scale: float | torch.Tensor | None,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Paged attention for the batch's new tokens.

        q [T, num_heads, head_size] in ``spec.model_dtype``; kv_cache
        [pages, 2, page_size, kv_heads, head_size] in the model dtype (scales 1.0), a quantized
        layer's dequantized float32 cache (scales 1.0), FP8 (read in place with ``k_scale`` /
        ``v_scale``), or a per-(token, head) layer's codes (int8 / FP8) read in place with
        ``kv_scale`` [pages, 2, kv_heads, page_size] float32 (None for every other mode). Returns [T, num_heads, head_size] in the model
        dtype, or float8_e4m3fn scaled by ``1 / output_scale`` when ``output_scale`` is given (a
        float, or a 0-d float32 tensor read on the device, only for kernels whose capability row
        sets ``tensor_output_scale``). ``kv_scale`` [pages, 2, kv_heads, page_size] float32: the
        per-(token, head) scales of a cache of int8 / e4m3 codes (``k_scale`` / ``v_scale`` then
        1.0); None for every other cache.
        The output is a new contiguous tensor whatever q's strides (a transposed view included):
        the ops' fake implementations promise exactly that to the compiler.
        """
