"""``PagedKV``: the base of every model served on per-layer paged KV caches.

It owns, in one place, what such a model does with its attention layers: resolve the per-layer
specs from a ``KVCacheConfig`` (with tensor parallelism: from the global config, checked equal on
every rank, then given this rank's heads), size the sliding-window pools, build one
``Attention`` (with its cache) per layer, build the page allocator, and open forward contexts
with the model's specs and kernel(s). A subclass says what its layers are (``layer_infos``),
where each layer's ``Attention`` lives (``_attention_slots``) and what every rank must agree on
(``_rank_facts``). Our decoders (``models.base.PagedDecoder``) and Hugging Face models
(``integrations.transformers.KVQCausalLM``) derive from it, so ``generate``,
``DecodeGraphRunner``, ``calibrate_kv_scales`` and the passes serve both alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from torch_kvq.attention import registry
from torch_kvq.attention.allocator import PageAllocator
from torch_kvq.attention.context import ForwardContext, forward_context
from torch_kvq.attention.kernels.base import AttentionKernel
from torch_kvq.attention.kernels.reference import ReferenceKernel
from torch_kvq.attention.layer import Attention, QuantForm
from torch_kvq.attention.memory import WindowPages, layer_pages, window_pools
from torch_kvq.attention.metadata import BatchMetadata
from torch_kvq.distributed import TensorParallel, check_ranks_agree, shard_specs
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig, LayerKVSpec
from torch_kvq.spec_resolve import resolve_layer_specs


class PagedKV(nn.Module):
    """A model whose attention layers each have their own paged cache, per their ``LayerKVSpec``.

    Attributes (set by ``_init_kv``; ``kernel``, ``num_pages`` and ``window_pages`` may be
    reassigned, and take effect at the next ``forward_context`` / ``configure_kv``): ``dtype``,
    ``device``, ``num_pages`` (pages per layer cache), ``window_pages`` (see
    ``attention.memory.window_pools``), ``kernel`` (one ``AttentionKernel`` or layer name ->
    kernel), ``quant_form``, ``tp``. Set by ``configure_kv``: ``kv_config``, ``kv_specs`` (this
    rank's), ``global_kv_specs``, ``allocator``.
    """

    def _init_kv(
        self,
        *,
        dtype: torch.dtype,
        device: torch.device,
        num_pages: int,
        kernel: AttentionKernel | Mapping[str, AttentionKernel] | None,
        quant_form: QuantForm,
        window_pages: WindowPages,
        tp: TensorParallel | None,
    ) -> None:
        """The settings ``configure_kv`` builds from (no layer is built here)."""
        self.dtype = dtype
        self.device = device
        self.num_pages = num_pages
        self.window_pages = window_pages
        self.kernel = kernel if kernel is not None else ReferenceKernel()
        self.quant_form: QuantForm = quant_form
        self.tp = tp  # tensor parallelism: this rank's heads (torch_kvq.distributed)
        self._specs: tuple[LayerKVSpec, ...] = ()

    # --- what a subclass says ------------------------------------------------------------------

    def layer_infos(self) -> list[AttentionLayerInfo]:
        """What the model declares about each attention layer (no quantization choices)."""
        raise NotImplementedError

    def _attention_slots(self) -> list[tuple[nn.Module, str]]:
        """Per layer, in ``layer_infos`` order: (module, attribute) holding its ``Attention``."""
        raise NotImplementedError

    def _rank_facts(self) -> Mapping[str, Any]:
        """Model facts every tensor-parallel rank must agree on (read only with ``tp``)."""
        raise NotImplementedError

    def _layer_config(self, kv_config: KVCacheConfig) -> KVCacheConfig:
        """``kv_config`` as resolved against ``layer_infos`` (a subclass may rename keys)."""
        return kv_config

    # --- the KV cache ----------------------------------------------------------------------------

    def configure_kv(self, kv_config: KVCacheConfig) -> None:
        """Re-resolve the per-layer specs and replace every ``Attention`` (fresh, empty caches) and
        the page allocator. On a bad config nothing changes (ValueError). With ``tp`` the specs are
        resolved from the global config, checked equal on every rank (a collective), then given
        this rank's heads."""
        global_specs = self.resolve_kv_specs(kv_config)
        facts = self._rank_facts() if self.tp is not None else None
        check_ranks_agree(self.tp, global_specs, self.kernel, facts)
        specs = shard_specs(global_specs, self.tp)
        pools = window_pools(specs, self.window_pages)
        self._release_attention()
        for (module, attr), spec in zip(self._attention_slots(), specs):
            pages = layer_pages(spec, self.num_pages, pools)
            setattr(module, attr, Attention(spec, pages, self.device, self.quant_form))
        self.kv_config = kv_config
        self._specs = specs
        self.global_kv_specs = global_specs
        self.allocator = PageAllocator(self.num_pages, kv_config.page_size, pools)

    def resolve_kv_specs(self, kv_config: KVCacheConfig) -> tuple[LayerKVSpec, ...]:
        """The per-layer specs ``kv_config`` gives this model (the whole model's, before any tensor
        parallel split), changing nothing: a bad config raises here, before a caller spends time
        on the configs before it."""
        return resolve_layer_specs(self._layer_config(kv_config), self.layer_infos(), self.dtype)

    def _release_attention(self) -> None:
        """Remove every layer's ``Attention`` (and its name from the live-layer registry)."""
        for module, attr in self._attention_slots():
            old = getattr(module, attr, None)
            if old is not None:
                registry.unregister(old)
                delattr(module, attr)

    @property
    def kv_specs(self) -> tuple[LayerKVSpec, ...]:
        return self._specs

    @property
    def attention_layers(self) -> list[Attention]:
        return [getattr(module, attr) for module, attr in self._attention_slots()]

    def forward_context(self, metadata: BatchMetadata) -> AbstractContextManager[ForwardContext]:
        """``attention.forward_context`` with this model's specs and kernel(s)."""
        return forward_context(metadata, self._specs, self.kernel)
