"""Pieces shared by our decoders: RMSNorm, RoPE, gated MLP, self-attention, and ``PagedDecoder``.

Flat token layout: no batch dim. ``forward(input_ids [T], positions [T]) -> logits [T, vocab]``
(fp32), for the sequences of the ``BatchMetadata`` in the active forward context, concatenated
along T in its order. Numerics follow transformers' eager bf16 code op for op (norms in fp32,
RoPE cos/sin rounded to the model dtype) so parity holds to bf16 rounding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from torch_kvq.attention import registry
from torch_kvq.attention.kernels.base import AttentionKernel
from torch_kvq.attention.layer import Attention, QuantForm
from torch_kvq.attention.memory import WindowPages
from torch_kvq.attention.paged_kv import PagedKV
from torch_kvq.distributed import TensorParallel, linear, shard_tensor
from torch_kvq.models.config import DecoderConfig, RopeSpec, read_config
from torch_kvq.spec import MODEL_DTYPES, AttentionLayerInfo, KVCacheConfig, check_positive_int


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. ``offset=True`` is Gemma's ``x * (1 + w)`` in fp32; else Llama's
    ``w * x.to(dtype)``."""

    def __init__(
        self, dim: int, eps: float, offset: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, rope: RopeSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int -> (cos, sin) [T, head_dim] in ``dtype`` (frequencies in fp32)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.factor != 1.0:
        inv_freq = inv_freq / rope.factor
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos / sin [T, D] -> [T, H, D] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` whose output is the concatenation of ``parts``' outputs (weights and
    biases concatenated along the output dim): one GEMM instead of ``len(parts)``."""
    first = parts[0]
    out = nn.Linear(
        first.in_features,
        sum(p.out_features for p in parts),
        bias=first.bias is not None,
        dtype=first.weight.dtype,
        device=first.weight.device,
    )
    with torch.no_grad():
        out.weight.copy_(torch.cat([p.weight for p in parts]))
        if out.bias is not None:
            out.bias.copy_(torch.cat([p.bias for p in parts]))  # type: ignore[misc]
    return out


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU (silu) or GeGLU (gelu tanh). With ``tp``: this
    rank's ``intermediate_size / N`` slice, down_proj row-parallel (all-reduced)."""

    def __init__(
        self,
        cfg: DecoderConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = dict(bias=cfg.mlp_bias, dtype=dtype, device=device, tp=tp)
        h, i, what = cfg.hidden_size, cfg.intermediate_size, "intermediate_size"
        self.gate_proj = linear(h, i, row=False, what=what, **kw)
        self.up_proj = linear(h, i, row=False, what=what, **kw)
        self.down_proj = linear(i, h, row=True, what=what, **kw)
        self.gate_up_proj: nn.Linear | None = None  # set by fuse(): gate and up in one GEMM
        self.act = cfg.hidden_act

    def fuse(self) -> None:
        """Replace gate_proj / up_proj by one ``gate_up_proj`` (same outputs, one GEMM)."""
        if self.gate_up_proj is None:
            self.gate_up_proj = fused_linear([self.gate_proj, self.up_proj])
            self.gate_proj = self.up_proj = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * up)


class SelfAttention(nn.Module):
    """q/k/v projections, optional per-head q/k norms, RoPE, paged ``Attention``, o_proj.

    ``attn`` is set by ``PagedDecoder.configure_kv`` (``PagedKV``). forward(h [T, hidden], cos, sin) -> [T, hidden].
    With ``tp``: this rank's ``num_heads / N`` query and ``num_kv_heads / N`` KV heads, o_proj
    row-parallel (all-reduced).
    """

    def __init__(
        self,
        cfg: DecoderConfig,
        qk_norm: bool,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        n = tp.size if tp is not None else 1  # heads were checked divisible by PagedDecoder
        self.num_heads, self.num_kv_heads = cfg.num_heads // n, cfg.num_kv_heads // n
        self.head_dim = cfg.head_dim
        kw: dict[str, Any] = dict(bias=cfg.attention_bias, dtype=dtype, device=device, tp=tp)
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = linear(h, q, row=False, what="num_heads x head_dim", **kw)
        self.k_proj = linear(h, kv, row=False, what="num_kv_heads x head_dim", **kw)
        self.v_proj = linear(h, kv, row=False, what="num_kv_heads x head_dim", **kw)
        self.o_proj = linear(q, h, row=True, what="num_heads x head_dim", **kw)
        self.qkv_proj: nn.Linear | None = None  # set by fuse(): q, k and v in one GEMM
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, True, dtype, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, True, dtype, device)
        self.attn: Attention | None = None

    def fuse(self) -> None:
        """Replace q/k/v_proj by one ``qkv_proj`` (same outputs, one GEMM). k and v are then
        strided views of its output; the cache write reads them in place."""
        if self.qkv_proj is None:
            self.qkv_proj = fused_linear([self.q_proj, self.k_proj, self.v_proj])
            self.q_proj = self.k_proj = self.v_proj = None  # type: ignore[assignment]

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t, kv = h.shape[0], self.num_kv_heads * self.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(h).split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        else:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        assert self.attn is not None, "configure_kv() sets the attention layer"
        out = self.attn(q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """One layer's norms, ``self_attn`` and ``mlp`` (transformers' names); subclasses give the
    forward. Gemma 3 (``cfg.arch``) has ``1 + w`` norms, q/k norms and norms around the MLP."""

    def __init__(
        self,
        cfg: DecoderConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel | None,
    ) -> None:
        super().__init__()
        gemma = cfg.arch == "gemma3"
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma, dtype, device)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = SelfAttention(cfg, qk_norm=gemma, dtype=dtype, device=device, tp=tp)
        self.post_attention_layernorm = norm()
        if gemma:
            self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(cfg, dtype, device, tp)
        if gemma:
            self.post_feedforward_layernorm = norm()


class PagedDecoder(PagedKV):
    """Base of ``LlamaModel`` / ``Gemma3Model``: embeddings, layers, final norm, LM head; the
    paged KV (``configure_kv``, ``kv_specs``, ``allocator``, ``forward_context``) is ``PagedKV``'s.

    Subclasses set ``arch`` and ``layer_class`` (and may override ``_embed``).
    Attention layer names are ``f"{prefix}.layers.{i}.self_attn.attn"`` (the module path).
    """

    arch: ClassVar[str]
    layer_class: ClassVar[type[DecoderLayer]]

    def __init__(
        self,
        hf_config: Any,
        kv_config: KVCacheConfig,
        num_pages: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        prefix: str | None = None,
        kernel: AttentionKernel | Mapping[str, AttentionKernel] | None = None,
        quant_form: QuantForm = "op",
        window_pages: WindowPages = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype {dtype} unsupported; expected one of {MODEL_DTYPES}")
        check_positive_int(num_pages, "num_pages")
        if prefix is not None and (
            not isinstance(prefix, str) or not prefix or prefix.endswith(".")
        ):
            raise ValueError(f"prefix must be a non-empty string not ending in '.', got {prefix!r}")
        if quant_form not in ("op", "torch"):
            raise ValueError(f"quant_form {quant_form!r} unknown; expected 'op' or 'torch'")
        self.config = cfg = read_config(hf_config, self.arch)
        if tp is not None:  # this rank's heads / MLP slice (torch_kvq.distributed)
            tp.split(cfg.num_heads, "num_heads")
            tp.split(cfg.num_kv_heads, "num_kv_heads")
            tp.split(cfg.intermediate_size, "intermediate_size")
        self._init_kv(
            dtype=dtype,
            device=torch.device(device),
            num_pages=num_pages,
            kernel=kernel,
            quant_form=quant_form,
            window_pages=window_pages,
            tp=tp,
        )
        self.prefix = prefix if prefix is not None else registry.unique_prefix("model")
        dev = self.device
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=dev)
        self.layers = nn.ModuleList(
            [self.layer_class(cfg, self.dtype, dev, self.tp) for _ in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.arch == "gemma3", dtype, dev)
        self.lm_head: nn.Linear | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(
                cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=dev
            )
        self._rope_types = tuple(sorted(set(cfg.layer_types)))
        self.configure_kv(kv_config)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    # --- KV cache ---------------------------------------------------------------------------

    def layer_infos(self) -> list[AttentionLayerInfo]:
        """What this model declares about each attention layer (no quantization choices)."""
        cfg = self.config
        return [
            AttentionLayerInfo(
                name=f"{self.prefix}.layers.{i}.self_attn.attn",
                num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads,
                head_size=cfg.head_dim,
                sliding_window=cfg.layer_window(i),
                logits_soft_cap=cfg.attn_logit_softcapping,
                sm_scale=cfg.sm_scale,
            )
            for i in range(cfg.num_layers)
        ]

    def _attention_slots(self) -> list[tuple[nn.Module, str]]:
        return [(layer.self_attn, "attn") for layer in self.layers]

    def _rank_facts(self) -> Mapping[str, Any]:
        return {"config": self.config}

    # --- weights ----------------------------------------------------------------------------

    @property
    def projections_fused(self) -> bool:
        return any(layer.self_attn.qkv_proj is not None for layer in self.layers)

    def fuse_projections(self) -> None:
        """Fuse each layer's q/k/v projections into one GEMM and gate/up into one, as serving
        engines do (vLLM's QKVParallelLinear / MergedColumnParallelLinear). The outputs are the
        same products; fewer, larger GEMMs. Load weights first: ``load_hf_state_dict`` takes
        transformers' unfused names only. Idempotent."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load a transformers ``*ForCausalLM`` state dict (keys ``model.*`` and ``lm_head.weight``).

        Every parameter must be given with its shape; unknown keys are an error. With ``tp``, give
        the full (unsharded) weights: each rank keeps its part.
        """
        if self.projections_fused:
            raise ValueError(
                f"{type(self).__name__}'s projections are fused (fuse_projections()); "
                "load_hf_state_dict takes transformers' unfused weights: load them first"
            )
        own = self.state_dict()
        given: dict[str, torch.Tensor] = {}
        for key, value in state_dict.items():
            ours = key.removeprefix("model.")
            if ours == "lm_head.weight" and self.lm_head is None:
                continue  # tied to embed_tokens.weight
            given[ours] = shard_tensor(ours, value, self.tp)  # full weights: this rank's part
        missing = sorted(set(own) - set(given))
        unexpected = sorted(set(given) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"state dict does not fit {type(self).__name__}: missing {missing[:6]}"
                f"{'...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}"
                f"{'...' if len(unexpected) > 6 else ''}"
            )
        for key, value in given.items():
            if tuple(value.shape) != tuple(own[key].shape):
                raise ValueError(
                    f"{key}: shape {tuple(value.shape)}, expected {tuple(own[key].shape)}"
                )
        with torch.no_grad():
            for key, value in given.items():
                own[key].copy_(value.to(dtype=self.dtype, device=self.device))

    # --- forward ----------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [T], positions [T] (int) -> logits [T, vocab] fp32; with ``logits_indices``
        [N] (int, rows of the token axis, e.g. each prompt's last token) only those rows: logits
        [N, vocab] (a 16k-token prefill then skips a [16k, vocab] head)."""
        if input_ids.dim() != 1 or tuple(positions.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"expected input_ids [T] and positions [T], got {tuple(input_ids.shape)} and "
                f"{tuple(positions.shape)}"
            )
        cfg = self.config
        h = self._embed(input_ids)
        rope = {}  # a loop, not a comprehension: depyf 0.20 cannot decompile the closure cells
        for t in self._rope_types:
            rope[t] = rope_cos_sin(positions, cfg.head_dim, cfg.rope[t], self.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, *rope[cfg.layer_types[i]])
        if logits_indices is not None:
            h = h.index_select(0, logits_indices)
        h = self.norm(h)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, weight)
        cap = cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
