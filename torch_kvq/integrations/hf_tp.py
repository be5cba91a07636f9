"""Tensor parallelism for an unmodified transformers model: its modules sharded in place.

Not transformers' own ``tp_plan`` / DTensor path (docs/tensor-parallel.md says why): each
decoder layer's ``q_proj`` / ``k_proj`` / ``v_proj`` and ``mlp.gate_proj`` / ``up_proj`` keep
this rank's output rows (column-parallel, plain ``nn.Linear`` with fewer outputs), ``o_proj`` and
``mlp.down_proj`` become ``RowParallelLinear`` (this rank's input columns, then a functional
all-reduce). HF's attention reshapes with ``-1`` heads, so it runs on the rank's heads unchanged;
embeddings, norms and the LM head stay replicated. Layers without those separate projections
(fused ``qkv_proj`` as in Phi-3, mixture-of-experts MLPs) are refused, naming the module.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from torch_kvq.distributed import RowParallelLinear, TensorParallel, shard_linear_
from torch_kvq.integrations.hf_attention import HFAttentionCall

ATTN_PROJ = (("q_proj", "k_proj", "v_proj"), "o_proj")
MLP_PROJ = (("gate_proj", "up_proj"), "down_proj")


def _projections(
    module: nn.Module, path: str, column: Sequence[str], row: str, what: str
) -> list[str]:
    names = [*column, row]
    missing = [n for n in names if not isinstance(getattr(module, n, None), nn.Linear)]
    if missing:
        have = sorted(n for n, m in module.named_children() if isinstance(m, nn.Linear))
        raise ValueError(
            f"{path} ({type(module).__name__}): tensor parallelism shards the {what} "
            f"projections {names} (nn.Linear each), this module lacks {missing} (its Linear "
            f"children: {have}); fused or mixture-of-experts layers are not supported"
        )
    return names


def check_shardable(
    model: nn.Module, calls: Sequence[HFAttentionCall], paths: Sequence[str], tp: TensorParallel
) -> None:
    """ValueError before anything changes: heads not divisible, projections not found."""
    for call, path in zip(calls, paths):
        tp.split(call.num_heads, f"layer {path!r}: num_heads")
        tp.split(call.num_kv_heads, f"layer {path!r}: num_kv_heads")
        _projections(call.module, path, *ATTN_PROJ, "attention")
        mlp_path = f"{path.rpartition('.')[0]}.mlp"
        mlp = model.get_submodule(mlp_path)
        _projections(mlp, mlp_path, *MLP_PROJ, "MLP")
        tp.split(mlp.gate_proj.out_features, f"{mlp_path}: intermediate size")


def shard_hf_model_(
    model: nn.Module, calls: Sequence[HFAttentionCall], paths: Sequence[str], tp: TensorParallel
) -> None:
    """Shard every decoder layer of ``model`` (attention modules at ``paths``) for ``tp``."""
    check_shardable(model, calls, paths, tp)
    for call, path in zip(calls, paths):
        mlp_path = f"{path.rpartition('.')[0]}.mlp"
        for module, prefix, (column, row) in (
            (call.module, path, ATTN_PROJ),
            (model.get_submodule(mlp_path), mlp_path, MLP_PROJ),
        ):
            for name in column:
                shard_linear_(module, name, tp, f"{prefix}.{name}")
            full = getattr(module, row)
            setattr(module, row, RowParallelLinear.from_linear(full, tp, f"{prefix}.{row}"))
