"""Bring your own model: an unmodified Hugging Face transformers decoder on the per-layer paged KV
cache, compiled with the kvq passes (``KVQCausalLM.from_hf``).

As the serving engines do it (vLLM's and SGLang's Transformers backends, TensorRT-LLM
AutoDeploy's transformers mode): register an attention function with
``transformers.AttentionInterface``, switch the model's (text) config to it, give every HF
attention module its own ``torch_kvq.Attention(spec, num_pages)`` (submodule ``kvq_attn``: the
paged cache is a module buffer, so it flows through the compiled graph), and call the model with
one flat token batch ``[1, T]``, explicit ``position_ids`` and ``use_cache=False`` inside the
forward context. Layer facts (heads, KV heads, head size, scaling, sliding window, soft-cap) are
what HF really passes, recorded by a one-token dry run (``hf_attention.py``).

Layer names are the HF module paths of the attention modules, e.g. ``model.layers.3.self_attn``
(``model.language_model.layers.3.self_attn`` in a multimodal model). Skip rules and ``kv_scales``
use them: ``"sliding_window"`` / ``"full_attention"`` (a layer is sliding when HF passes it a
window: ``layer_types`` / ``sliding_window`` of the config), indices, globs such as
``"model.layers.1*"``, exact names. When another live model already uses those names, the first
component gets a suffix (``model_1.layers.3.self_attn``), as the project's own decoders do;
``prefix=`` picks it.

Multimodal models: only the text decoder is attached (its config is switched and its attention
layers get paged caches); vision / audio towers keep their own attention and are never called by
``forward``, which takes token ids. Refused at attach (``hf_checks.py``): encoder-decoder models,
MLA, attention sinks, chunked attention, non-causal layers, cross-layer KV sharing, dynamic RoPE.

``lm = KVQCausalLM.from_hf(hf_model, kv_config, num_pages=...)`` is a ``PagedKV`` like
``PagedDecoder`` (``kv_specs``, ``configure_kv``, ``allocator``, ``forward_context``,
``attention_layers``) with ``forward(input_ids [T], positions [T]) -> logits [T, vocab]`` fp32, so
``torch_kvq.models.generate``, ``DecodeGraphRunner``, ``calibrate_kv_scales`` and
``torch.compile(lm, backend=kvq_backend)`` work unchanged. ``lm.generate(input_ids,
attention_mask=..., **kw)`` runs HF's own ``generate`` through the paged cache (``hf_generate.py``).
Tested with transformers 5.24.0 and 4.57.6 (CPU, torch 2.13); the code paths also ran on 4.54.1.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from torch_kvq.attention import registry
from torch_kvq.attention.kernels.base import AttentionKernel
from torch_kvq.attention.layer import QuantForm
from torch_kvq.attention.memory import WindowPages
from torch_kvq.attention.paged_kv import PagedKV
from torch_kvq.distributed import TensorParallel
from torch_kvq.integrations import hf_attention as hfa
from torch_kvq.integrations.hf_checks import check_layer, check_model
from torch_kvq.integrations.hf_generate import KVQPagedCache, install_forward
from torch_kvq.integrations.hf_scales import (
    ScaleSource,
    checkpoint_k_bases,
    checkpoint_k_channel_scales,
    checkpoint_kv_scales,
    layer_table,
)
from torch_kvq.integrations.hf_tp import shard_hf_model_
from torch_kvq.spec import MODEL_DTYPES, AttentionLayerInfo, KVCacheConfig, check_positive_int
from torch_kvq.spec_channels import KBasis, KChannelScale
from torch_kvq.spec_modes import KVQuantMode
from torch_kvq.spec_resolve import layer_modes


def _layer_names(paths: list[str], prefix: str | None) -> list[str]:
    """HF module paths, or with their first component replaced when taken / ``prefix`` given."""
    if prefix is None and not any(registry.is_live(p) for p in paths):
        return paths
    parts = [p.partition(".") for p in paths]  # (first component, ".", rest)
    new = {h: prefix if prefix is not None else registry.unique_prefix(h) for h, _, _ in parts}
    return [new[head] + dot + rest for head, dot, rest in parts]


class KVQCausalLM(PagedKV):
    """An HF causal LM served by torch-kvq's per-layer paged KV cache (see the module docstring);
    the paged KV (``configure_kv``, ``kv_specs``, ``allocator``, ``forward_context``) is
    ``PagedKV``'s, as for our own decoders.

    forward(input_ids [T], positions [T]) -> logits [T, vocab] fp32, for the sequences of the
    ``BatchMetadata`` in the active forward context (``lm.forward_context(md)``), concatenated
    along T in its order.
    """

    def __init__(
        self,
        hf_model: nn.Module,
        calls: list[hfa.HFAttentionCall],
        paths: list[str],
        kv_config: KVCacheConfig,
        num_pages: int,
        *,
        prefix: str | None,
        kernel: AttentionKernel | Mapping[str, AttentionKernel] | None,
        quant_form: QuantForm,
        window_pages: WindowPages,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config.get_text_config(decoder=True)
        self._init_kv(
            dtype=hf_model.dtype,
            device=next(hf_model.parameters()).device,
            num_pages=num_pages,
            kernel=kernel,
            quant_form=quant_form,
            window_pages=window_pages,
            tp=tp,
        )
        self._hf_attn = [c.module for c in calls]  # plain list: not registered twice
        self.layer_paths = dict(zip(_layer_names(paths, prefix), paths))  # name -> HF path
        self.prefix = next(iter(self.layer_paths)).split(".", 1)[0]
        self._calls = calls
        self.configure_kv(kv_config)
        self._old_impl = self.config._attn_implementation
        self.config._attn_implementation = hfa.SERVE
        self._hf_forward = install_forward(self)

    @classmethod
    def from_hf(
        cls,
        hf_model: nn.Module,
        kv_config: KVCacheConfig,
        *,
        num_pages: int,
        kernel: AttentionKernel | Mapping[str, AttentionKernel] | None = None,
        prefix: str | None = None,
        quant_form: QuantForm = "op",
        kv_scales_from: ScaleSource | None = None,
        k_channels_from: ScaleSource | None = None,
        k_bases_from: ScaleSource | None = None,
        window_pages: WindowPages = None,
        tp: TensorParallel | None = None,
    ) -> KVQCausalLM:
        """Attach ``hf_model`` (a transformers ``*ForCausalLM`` or multimodal ``*ForConditional
        Generation``, eval mode) to per-layer paged caches of ``num_pages`` pages each
        (``window_pages``: a pool of its own per sliding window, see ``PagedDecoder``).

        ``kv_scales_from``: a safetensors file, a folder of them, or a state dict holding FP8-KV
        checkpoint scales (``...self_attn.k_scale`` / ``v_scale``, ``k_proj.output_scale``, ...);
        they become ``kv_config.kv_scales`` (which must then be empty). ``k_channels_from``: the
        same kinds of source holding K channel scales (``P.k_channel_scale`` / ``k_channel_mean``,
        what ``kvq calibrate`` writes); they become ``kv_config.k_channel_scales`` (then empty)
        for the layers whose mode is ``int4_per_token_head`` (ValueError if none is);
        ``k_bases_from`` likewise the K bases (``P.k_basis``) of the ``tc4_per_token_head``
        layers, into ``kv_config.k_bases``. Raises ValueError naming
        the layer and the feature for what the paged cache cannot serve; nothing is attached then.

        ``tp``: shard the model in place for tensor parallelism (``hf_tp.py``: q/k/v and gate/up
        column-parallel, o_proj and down_proj row-parallel with an all-reduce); every rank calls
        this with the same full model and config; each rank's caches hold its KV heads.
        ``detach()`` gives the model back still sharded.
        """
        hfa.register()
        if getattr(hf_model, "_kvq_attached", False):
            raise ValueError(f"{type(hf_model).__name__} is already attached; detach() it first")
        check_positive_int(num_pages, "num_pages")
        if hf_model.dtype not in MODEL_DTYPES:
            raise ValueError(f"model dtype {hf_model.dtype} unsupported; expected {MODEL_DTYPES}")
        text_config = hf_model.config.get_text_config(decoder=True)
        check_model(hf_model, text_config)
        dev = next(hf_model.parameters()).device
        one = torch.zeros(1, 1, dtype=torch.long, device=dev)
        calls = hfa.record_calls(
            hf_model,
            text_config,
            lambda: hf_model(input_ids=one, position_ids=one, use_cache=False),
        )
        names = {id(m): n for n, m in hf_model.named_modules()}
        if not calls:
            raise ValueError(
                f"{type(hf_model).__name__}: no layer called the attention interface in a one-token "
                "dry run; the model does not dispatch through transformers.AttentionInterface"
            )
        paths = [names.get(id(c.module), "?") for c in calls]
        if len(set(paths)) != len(paths) or "?" in paths:
            raise ValueError(f"attention modules called more than once or not found: {paths}")
        for call, path in zip(calls, paths):
            check_layer(call, path, text_config)
        if kv_scales_from is not None:
            if kv_config.kv_scales:
                raise ValueError("give kv_config.kv_scales or kv_scales_from, not both")
            scales = checkpoint_kv_scales(kv_scales_from, paths)
            kept = _mode_paths(
                kv_config, calls, paths, prefix, hf_model.dtype, KVQuantMode.FP8_PER_TENSOR
            )
            kv_config = _with_scales(kv_config, {p: s for p, s in scales.items() if p in kept})
        if k_channels_from is not None:
            if kv_config.k_channel_scales:
                raise ValueError("give kv_config.k_channel_scales or k_channels_from, not both")
            int4 = _mode_paths(
                kv_config, calls, paths, prefix, hf_model.dtype, KVQuantMode.INT4_PER_TOKEN_HEAD
            )
            channels = checkpoint_k_channel_scales(k_channels_from, paths)
            kv_config = replace(
                kv_config,
                k_channel_scales=layer_table(
                    channels, int4, "K channel scales", "int4_per_token_head", "kvq calibrate"
                ),
            )
        if k_bases_from is not None:
            if kv_config.k_bases:
                raise ValueError("give kv_config.k_bases or k_bases_from, not both")
            tc4 = _mode_paths(
                kv_config, calls, paths, prefix, hf_model.dtype, KVQuantMode.TC4_PER_TOKEN_HEAD
            )
            table = layer_table(
                checkpoint_k_bases(k_bases_from, paths), tc4, "K bases", "tc4_per_token_head",
                "kvq calibrate",
            )  # fmt: skip
            kv_config = replace(kv_config, k_bases=table)
        if tp is not None:
            shard_hf_model_(hf_model, calls, paths, tp)  # the dry run above saw the global heads
        lm = cls(
            hf_model,
            calls,
            paths,
            kv_config,
            num_pages,
            prefix=prefix,
            kernel=kernel,
            quant_form=quant_form,
            window_pages=window_pages,
            tp=tp,
        )
        hf_model._kvq_attached = True
        return lm

    # --- KV cache (PagedDecoder's API) -------------------------------------------------------

    def with_k_channels(
        self, cfg: KVCacheConfig, channels: Mapping[str, KChannelScale]
    ) -> KVCacheConfig:
        """``cfg`` with ``channels`` (HF path -> ``KChannelScale``, e.g. ``kvq calibrate``'s) as
        the K channel scales of its ``int4_per_token_head`` layers (by the layers' modes alone,
        as ``with_k_bases``: a map with tc4 layers takes either first). ValueError if ``cfg`` has
        no such layer or ``channels`` misses one of them."""
        int4 = self._paths_where(cfg, lambda m: m is KVQuantMode.INT4_PER_TOKEN_HEAD)
        return replace(
            cfg,
            k_channel_scales=layer_table(
                channels, int4, "K channel scales", "int4_per_token_head", "kvq calibrate"
            ),
        )

    def with_k_bases(self, cfg: KVCacheConfig, bases: Mapping[str, KBasis]) -> KVCacheConfig:
        """``cfg`` with ``bases`` (HF path -> ``KBasis``, e.g. ``calibrate.k_bases``'s) as the K
        bases of its ``tc4_per_token_head`` layers. ValueError if ``cfg`` has no such layer or
        ``bases`` misses one of them."""
        tc4 = self._paths_where(cfg, lambda m: m.transform_coded)
        table = layer_table(bases, tc4, "K bases", "tc4_per_token_head", "basis=calibrate")
        return replace(cfg, k_bases=table)

    def _paths_where(self, cfg: KVCacheConfig, keep: Callable[[KVQuantMode], bool]) -> set[str]:
        """HF paths of the layers whose mode under ``cfg``'s rules ``keep`` takes (the modes
        alone: no per-layer table is checked, so tables can be attached in any order)."""
        modes = layer_modes(self._layer_config(cfg), self.layer_infos(), self.dtype)
        return {p for p, m in zip(self.layer_paths.values(), modes) if keep(m)}

    def layer_infos(self) -> list[AttentionLayerInfo]:
        """What HF passed each attention layer in the dry run (no quantization choices)."""
        return [_layer_info(name, c) for name, c in zip(self.layer_paths, self._calls)]

    def _attention_slots(self) -> list[tuple[nn.Module, str]]:
        return [(mod, hfa.ATTN_ATTR) for mod in self._hf_attn]

    def _rank_facts(self) -> Mapping[str, Any]:
        return {"config": self.config.to_json_string(use_diff=False)}

    def _layer_config(self, cfg: KVCacheConfig) -> KVCacheConfig:
        """``kv_scales`` keyed by HF path are accepted too when the names carry a prefix."""
        by_path = {p: n for n, p in self.layer_paths.items() if n != p}
        if not by_path:
            return cfg
        scales = tuple((by_path.get(k, k), v) for k, v in cfg.kv_scales)  # type: ignore[arg-type]
        channels = tuple((by_path.get(k, k), c) for k, c in cfg.k_channel_scales)  # type: ignore[arg-type]
        bases = tuple((by_path.get(k, k), b) for k, b in cfg.k_bases)  # type: ignore[arg-type]
        return replace(_with_scales(cfg, dict(scales)), k_channel_scales=channels, k_bases=bases)

    # --- forward -----------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [T], positions [T] (int) -> logits [T, vocab] fp32; with ``logits_indices``
        [N] only those positions' logits, [N, vocab] (transformers' ``logits_to_keep``: the LM
        head runs on those rows only)."""
        if input_ids.dim() != 1 or tuple(positions.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"expected input_ids [T] and positions [T], got {tuple(input_ids.shape)} and "
                f"{tuple(positions.shape)}"
            )
        kw: dict[str, Any] = {}
        if logits_indices is not None:
            kw["logits_to_keep"] = logits_indices
        out = self.hf(
            input_ids=input_ids[None], position_ids=positions[None], use_cache=False, **kw
        )
        return out.logits[0].float()

    def compiled_forward(
        self, backend: Any = None, **compile_kwargs: Any
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``torch.compile(self, backend=backend or kvq_backend, fullgraph=True, **kw)``, called
        with the token dim (and ``logits_indices``' length) marked dynamic: one graph serves the
        prefill and every decode step with T >= 2 tokens (T = 1 gets a second graph: Dynamo
        specializes sizes 0 and 1; so do a call without ``logits_indices`` and one with one row)."""
        if backend is None:
            from torch_kvq.passes import kvq_backend as backend
        compile_kwargs.setdefault("fullgraph", True)
        fn = torch.compile(self, backend=backend, **compile_kwargs)

        def run(input_ids: torch.Tensor, positions: torch.Tensor, **kw: Any) -> torch.Tensor:
            if input_ids.shape[0] > 1:
                torch._dynamo.mark_dynamic(input_ids, 0)
                torch._dynamo.mark_dynamic(positions, 0)
            rows = kw.get("logits_indices")
            if rows is not None:  # any number of logit rows (1 too: unbacked), one graph
                torch._dynamo.decorators.mark_unbacked(rows, 0)
            return fn(input_ids, positions, **kw)

        return run

    # --- HF generate through the paged cache ---------------------------------------------------

    def paged_cache(self) -> KVQPagedCache:
        """A fresh placeholder cache for one ``hf_model.generate`` call (a context manager)."""
        return KVQPagedCache(self)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """``hf_model.generate(input_ids, **kwargs)`` on the paged cache (left padding only);
        every page is freed afterwards."""
        params = inspect.signature(self._hf_forward).parameters
        key = "cache" if "cache" in params else "past_key_values"
        with self.paged_cache() as cache:
            return self.hf.generate(input_ids, **{key: cache}, **kwargs)

    def detach(self) -> nn.Module:
        """Give the HF model back as it was (attention implementation, forward, no kvq layers)."""
        self._release_attention()
        self.config._attn_implementation = self._old_impl
        self.hf.__dict__.pop("forward", None)
        self.hf._kvq_attached = False
        return self.hf


def _layer_info(name: str, c: hfa.HFAttentionCall) -> AttentionLayerInfo:
    return AttentionLayerInfo(
        name=name,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_size=c.head_size,
        sliding_window=c.sliding_window,
        logits_soft_cap=c.softcap,
        sm_scale=c.scaling,
    )


def _mode_paths(
    cfg: KVCacheConfig,
    calls: list[hfa.HFAttentionCall],
    paths: list[str],
    prefix: str | None,
    dtype: torch.dtype,
    mode: KVQuantMode,
) -> set[str]:
    """HF paths of the layers whose mode is ``mode``: checkpoint scales load for those only (fp8
    per tensor: a per-(token, head) layer computes its own scales, kv_scales for one is a
    ValueError; int4: the only mode K channel scales apply to; tc4: K bases)."""
    infos = [_layer_info(n, c) for n, c in zip(_layer_names(paths, prefix), calls)]
    return {p for p, m in zip(paths, layer_modes(cfg, infos, dtype)) if m is mode}


def _with_scales(
    cfg: KVCacheConfig, scales: Mapping[str | int, tuple[float, float]]
) -> KVCacheConfig:
    return replace(cfg, kv_scales=tuple(scales.items()))


__all__ = ["KVQCausalLM", "KVQPagedCache"]
