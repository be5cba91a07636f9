"""The two attention functions torch-kvq registers with ``transformers.AttentionInterface``.

``"kvq_record"`` (the one-token dry run at attach): records what each HF attention module really
passes (``HFAttentionCall``: heads, KV heads, head sizes, scaling, window, soft-cap, causality,
extra keyword arguments) and returns the exact one-token attention output so the run completes.

``"kvq"`` (serving): ``kvq_attention_forward`` runs the module's own ``torch_kvq.Attention`` (its
``kvq_attn`` submodule, whose paged cache is a module buffer) on the flat token layout.
Everything it checks is a Python value at trace time, so the compiled graph holds only the
``kvq.*`` ops, as on the project's own decoders.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SERVE = "kvq"  # attn_implementation name of the serving function
RECORD = "kvq_record"  # attn_implementation name of the dry-run recorder
ATTN_ATTR = "kvq_attn"  # the torch_kvq Attention submodule set on each HF attention module
SINK_KWARGS = ("s_aux", "sinks")  # gpt-oss passes its per-head sink logits as s_aux


@dataclass(frozen=True)
class HFAttentionCall:
    """What one HF attention module passed to the attention function in the dry run."""

    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_size: int  # of q
    k_head_size: int
    v_head_size: int
    scaling: float | None
    sliding_window: int | None
    softcap: float | None
    is_causal: bool
    sinks: bool  # attention-sink logits were passed (s_aux / sinks)
    kwarg_names: tuple[str, ...]


_local = threading.local()


def _recorder(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    calls: list[HFAttentionCall] | None = getattr(_local, "calls", None)
    if calls is None:
        raise RuntimeError("the kvq_record attention function runs only inside record_calls()")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    calls.append(
        HFAttentionCall(
            module=module,
            num_heads=int(query.shape[1]),
            num_kv_heads=int(key.shape[1]),
            head_size=int(query.shape[-1]),
            k_head_size=int(key.shape[-1]),
            v_head_size=int(value.shape[-1]),
            scaling=None if kwargs.get("scaling") is None else float(kwargs["scaling"]),
            sliding_window=None if window is None else int(window),
            softcap=None if kwargs.get("softcap") is None else float(kwargs["softcap"]),
            is_causal=bool(kwargs.get("is_causal", getattr(module, "is_causal", True))),
            sinks=any(kwargs.get(k) is not None for k in SINK_KWARGS),
            kwarg_names=tuple(sorted(kwargs)),
        )
    )
    # one key: softmax weight 1, so the output is v, repeated over each KV head's query group
    groups = max(1, query.shape[1] // key.shape[1])
    out = value.repeat_interleave(groups, dim=1).transpose(1, 2).contiguous()
    return out, None


def record_calls(model: nn.Module, config: Any, run: Any) -> list[HFAttentionCall]:
    """Switch ``config`` (a text config) to the recorder, call ``run()``, restore it; return the
    calls in order. ``run`` is a one-token forward of ``model``."""
    register()
    old = config._attn_implementation
    _local.calls = calls = []
    config._attn_implementation = RECORD
    try:
        with torch.no_grad():
            run()
    finally:
        config._attn_implementation = old
        _local.calls = None
    return calls


def kvq_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF q [1, H, T, D] (a transposed view), k / v [1, KH, T, D] -> (out [1, T, H, D], None),
    through the module's ``torch_kvq.Attention`` for the batch of the active forward context."""
    attn = getattr(module, ATTN_ATTR, None)
    if attn is None:
        raise RuntimeError(
            f"{type(module).__name__} (layer_idx {getattr(module, 'layer_idx', '?')}) runs the "
            f"{SERVE!r} attention implementation but has no torch_kvq Attention: attach the model "
            "with KVQCausalLM.from_hf"
        )
    name = attn.layer_name
    if query.shape[0] != 1:
        raise ValueError(
            f"layer {name!r}: the paged cache serves one flat token batch [1, T], got a batch of "
            f"{query.shape[0]}; call KVQCausalLM(input_ids [T], positions [T])"
        )
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"layer {name!r}: {key.shape[2]} keys for {query.shape[2]} new tokens: an HF cache was "
            "passed alongside the paged cache (a double write); call the model with "
            "use_cache=False and no cache"
        )
    if attention_mask is not None:
        raise ValueError(
            f"layer {name!r}: got an attention mask; the paged cache builds its own (causal, "
            "per sequence, from the forward context): pass no attention_mask"
        )
    if dropout:
        raise ValueError(f"layer {name!r}: attention dropout {dropout} (training) is unsupported")
    spec = attn.spec
    window, cap = kwargs.get("sliding_window", spec.sliding_window), kwargs.get("softcap")
    if window != spec.sliding_window or (cap is not None and cap != spec.logits_soft_cap):
        raise ValueError(
            f"layer {name!r}: HF passed sliding_window={window}, softcap={cap}; the spec has "
            f"{spec.sliding_window}, {spec.logits_soft_cap} (the config changed after attach?)"
        )
    if scaling is not None and abs(scaling - spec.sm_scale) > 1e-6 * spec.sm_scale:
        raise ValueError(
            f"layer {name!r}: HF passed scaling {scaling}, the spec has {spec.sm_scale}"
        )
    # [1, H, T, D] -> [T, H, D]; contiguous already when q is a transposed view of [1, T, H, D]
    q = query.transpose(1, 2)[0].contiguous()
    out = attn(q, key.transpose(1, 2)[0], value.transpose(1, 2)[0])
    return out.unsqueeze(0), None


_registered = False


def register() -> None:
    """Register both functions with ``transformers.AttentionInterface`` (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(SERVE, kvq_attention_forward)
    AttentionInterface.register(RECORD, _recorder)
    _registered = True
