"""Tensor parallelism on torch.distributed: sharding rules, row-parallel all-reduce, rank agreement.

Megatron-style, as vLLM does it: q/k/v and gate/up are column-parallel (each rank computes its
heads / its slice of the MLP), o_proj and down_proj row-parallel, their partial sums added by an
all-reduce (``torch.distributed._functional_collectives.all_reduce``: traceable, so a step compiles
with ``fullgraph=True`` and the kvq backend). Embeddings, norms and the LM head are replicated.
Each rank holds ``num_kv_heads / N`` KV heads (and ``num_heads / N`` query heads) of every layer's
paged cache: the per-layer specs are resolved once from the global config on every rank, checked
to agree across ranks (``check_ranks_agree``), then narrowed to the rank's heads (``shard_specs``).

Host-side refusals (a bad batch, no free pages) are agreed before anyone enters a collective
(``refuse_together``). ``torch_kvq.models`` and ``KVQCausalLM`` take ``tp=``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torch_kvq.spec import LayerKVSpec

T = TypeVar("T")
# weight / bias name suffixes (ours and transformers' alike) -> the dim sliced across ranks
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
FUSED = ("qkv_proj", "gate_up_proj")


class RankRefusedError(RuntimeError):
    """Another tensor-parallel rank refused the step; this rank refuses it too (no lone collective)."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group of ``size`` ranks.

    ``group``: the process group of the all-reduces (None: the default group). ``cpu_group``: a
    gloo group for host-side agreement (None: ``group``, right when that one is gloo).
    """

    rank: int
    size: int
    group: Any = None
    cpu_group: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensor-parallel size must be a positive int, got {self.size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ValueError(f"tensor-parallel rank must be an int, got {self.rank!r}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside [0, {self.size - 1}]")

    def split(self, n: int, what: str) -> int:
        """``n / size``; ValueError naming ``what`` when ``n`` is not divisible by the size."""
        if n % self.size:
            raise ValueError(
                f"{what} {n} is not divisible by the tensor-parallel size {self.size}; expected a "
                f"multiple of {self.size} (every rank holds {what} / {self.size})"
            )
        return n // self.size

    def part(self, n: int, what: str) -> slice:
        """This rank's slice of ``n`` (``n`` divisible by the size)."""
        k = self.split(n, what)
        return slice(self.rank * k, (self.rank + 1) * k)


def require_gpu(what: str, rank: int | None = None) -> torch.device:
    """The CUDA device of this rank (``LOCAL_RANK``), or RuntimeError naming the rank and why."""
    lr = int(os.environ.get("LOCAL_RANK", "0"))
    rank = int(os.environ.get("RANK", lr)) if rank is None else rank
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if lr >= n:
        raise RuntimeError(
            f"rank {rank} (LOCAL_RANK {lr}): {what} needs a CUDA GPU per rank, but this process sees "
            f"{n} CUDA device(s) (torch {torch.__version__}); expected at least {lr + 1}. Give "
            "every rank a GPU, or run on the CPU: --device cpu (backend gloo)"
        )
    return torch.device("cuda", lr)


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (its environment is set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def relaunch(nproc: int, target: Sequence[str]) -> int:
    """Run ``python <target...>`` (e.g. ``["-m", "torch_kvq.cli", "demo", ...]`` or a script and
    its arguments) on ``nproc`` local ranks with ``torchrun --standalone``; its exit code."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", *target]  # fmt: skip
    return subprocess.call(cmd)


def init_tensor_parallel(
    backend: str | None = None, device: str = "cpu", timeout_s: float | None = None
) -> TensorParallel:
    """Join (or start) the default process group from torchrun's environment and return this
    rank's ``TensorParallel`` over all ranks. ``backend`` None: nccl on cuda, gloo on cpu. On
    cuda also sets the rank's device and makes the gloo ``cpu_group`` for host agreement.
    ``timeout_s``: how long a collective may wait for the other ranks (torch's default if None)."""
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend {backend!r} unsupported; expected 'nccl' or 'gloo'")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} unsupported; expected 'cpu' or 'cuda'")
    if backend == "nccl" or device == "cuda":
        dev = require_gpu(f"backend {backend!r} on device {device!r}")
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        import datetime

        kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        dist.init_process_group(backend, **kw)
    cpu_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    return TensorParallel(dist.get_rank(), dist.get_world_size(), None, cpu_group)


# --- weights ---------------------------------------------------------------------------------


def shard_dim(name: str) -> int | None:
    """The dim of parameter ``name`` split across ranks: 0 (column-parallel), 1 (row-parallel
    weight), None (replicated: embeddings, norms, LM head, row-parallel biases)."""
    parts = name.split(".")
    owner, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])
    if owner in FUSED:
        raise ValueError(
            f"{name}: fused projections are sharded part by part; load or randomize weights "
            "before fuse_projections() (they take the unfused q/k/v and gate/up weights)"
        )
    if owner in COLUMN_PARALLEL:
        return 0
    if owner in ROW_PARALLEL and leaf == "weight":
        return 1
    return None


def full_shape(name: str, shape: Sequence[int], tp: TensorParallel | None) -> tuple[int, ...]:
    """The unsharded shape of a parameter whose shard on this rank has ``shape``."""
    dim = shard_dim(name) if tp is not None else None
    out = list(shape)
    if dim is not None:
        out[dim] *= tp.size  # type: ignore[union-attr]
    return tuple(out)


def shard_tensor(name: str, full: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """This rank's shard of the full (unsharded) parameter ``name``."""
    dim = shard_dim(name) if tp is not None else None
    if dim is None:
        return full
    return full.narrow(dim, tp.part(full.shape[dim], name).start, full.shape[dim] // tp.size)  # type: ignore[union-attr]


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` over this rank's input slice, then the sum over ranks (a functional
    all-reduce), then the bias (added once). Same parameter names as ``nn.Linear``."""

    def __init__(self, *args: Any, tp: TensorParallel, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = tp.group if tp.group is not None else dist.group.WORLD

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: TensorParallel, name: str) -> RowParallelLinear:
        """The row-parallel shard of a full ``linear`` (its input columns of this rank)."""
        w = linear.weight
        out = cls(
            tp.split(linear.in_features, f"{name}.in_features"),
            linear.out_features,
            bias=linear.bias is not None,
            dtype=w.dtype,
            device=w.device,
            tp=tp,
        )
        with torch.no_grad():
            out.weight.copy_(shard_tensor(f"{name}.weight", w, tp))
            if linear.bias is not None:
                out.bias.copy_(linear.bias)  # type: ignore[union-attr]
        return out


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``x`` over the group: ``_functional_collectives.all_reduce`` (torch 2.11-2.14)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x, "sum", group)


def linear(
    cfg_in: int, cfg_out: int, *, row: bool, tp: TensorParallel | None, what: str, **kw: Any
) -> nn.Linear:
    """An ``nn.Linear`` of the full shape ``(cfg_in -> cfg_out)``, or its shard on this rank:
    column-parallel (``row=False``: out split) or ``RowParallelLinear`` (in split)."""
    if tp is None:
        return nn.Linear(cfg_in, cfg_out, **kw)
    if row:
        return RowParallelLinear(tp.split(cfg_in, what), cfg_out, tp=tp, **kw)
    return nn.Linear(cfg_in, tp.split(cfg_out, what), **kw)


@torch.no_grad()
def shard_linear_(parent: nn.Module, attr: str, tp: TensorParallel, name: str) -> None:
    """Replace ``parent.<attr>`` (a full ``nn.Linear``) by its column-parallel shard in place."""
    lin: nn.Linear = getattr(parent, attr)
    part = tp.part(lin.out_features, f"{name}.out_features")
    lin.weight = nn.Parameter(lin.weight[part].clone(), requires_grad=False)
    if lin.bias is not None:
        lin.bias = nn.Parameter(lin.bias[part].clone(), requires_grad=False)
    lin.out_features = part.stop - part.start


# --- specs and rank agreement ------------------------------------------------------------------


def shard_specs(specs: Sequence[LayerKVSpec], tp: TensorParallel | None) -> tuple[LayerKVSpec, ...]:
    """The specs of this rank: the same as ``specs`` but for ``num_heads / N``, ``num_kv_heads / N``
    (and a ``k_channel`` / ``k_basis`` of this rank's kv heads)."""
    if tp is None:
        return tuple(specs)

    def mine(s: LayerKVSpec) -> LayerKVSpec:
        part = tp.part(s.num_kv_heads, f"layer {s.name!r}: num_kv_heads")
        return replace(
            s,
            num_heads=tp.split(s.num_heads, f"layer {s.name!r}: num_heads"),
            num_kv_heads=tp.split(s.num_kv_heads, f"layer {s.name!r}: num_kv_heads"),
            k_channel=None if s.k_channel is None else s.k_channel.heads(part),
            k_basis=None if s.k_basis is None else s.k_basis.heads(part),
        )

    return tuple(mine(s) for s in specs)


def describe_kernel(kernel: object) -> str:
    """A kernel's type and its plain settings (what decides fusions and kernels per layer)."""
    plain = {
        k: v
        for k, v in sorted(vars(kernel).items())
        if not k.startswith("_") and isinstance(v, (str, int, float, bool, type(None)))
    }
    return f"{type(kernel).__name__}{plain}"


def rank_table(
    specs: Sequence[LayerKVSpec], kernel: object, extra: Mapping[str, object] | None = None
) -> dict[str, object]:
    """What every rank must agree on: the global per-layer specs, each layer's kernel, ``extra``
    (e.g. the model config). Keys are ``"<layer> <field>"``; values printable."""
    kernels = kernel if isinstance(kernel, Mapping) else {}
    table: dict[str, object] = {f"model {k}": repr(v) for k, v in (extra or {}).items()}
    table["layers"] = repr([s.name for s in specs])
    for s in specs:
        for field, value in s.as_dict().items():
            table[f"layer {s.name!r} {field}"] = value
        table[f"layer {s.name!r} kernel"] = describe_kernel(kernels.get(s.name, kernel))
    return table


def compare_tables(tables: Sequence[Mapping[str, object]]) -> None:
    """ValueError naming the first value where a rank's table differs from rank 0's."""
    first = tables[0]
    for rank, table in enumerate(tables[1:], start=1):
        if repr(sorted(table.items())) == repr(sorted(first.items())):
            continue
        for key in [*first, *(k for k in table if k not in first)]:
            a, b = first.get(key, "<missing>"), table.get(key, "<missing>")
            if a != b:
                raise ValueError(
                    f"tensor-parallel ranks disagree on {key}: rank 0 has {a!r}, rank {rank} has "
                    f"{b!r}; expected the same on every rank (build the model from the same config, "
                    "KV config, skip rules, scales and kernel everywhere)"
                )


def gather(tp: TensorParallel, obj: T) -> list[T]:
    """``obj`` of every rank, in rank order (host-side, over the gloo ``cpu_group``)."""
    out: list[Any] = [None] * tp.size
    dist.all_gather_object(out, obj, group=tp.cpu_group or tp.group)
    return out


def check_ranks_agree(
    tp: TensorParallel | None,
    specs: Sequence[LayerKVSpec],
    kernel: object,
    extra: Mapping[str, object] | None = None,
) -> None:
    """Every rank resolved the same global specs, kernels and ``extra``; else every rank raises
    the same ValueError naming the differing value (a collective: call on every rank)."""
    if tp is None or tp.size == 1:
        return
    compare_tables(gather(tp, rank_table(specs, kernel, extra)))


def agree(
    tp: TensorParallel | None, error: BaseException | None, what: str, signature: object = None
) -> None:
    """Raise on every rank if any rank has an ``error`` (its own error on that rank,
    ``RankRefusedError`` naming it elsewhere) or the ranks' ``signature``s differ (ValueError).
    A collective: every rank calls it for the same step."""
    if tp is None or tp.size == 1:
        if error is not None:
            raise error
        return
    local = None if error is None else f"{type(error).__name__}: {error}"
    sig = repr(signature)
    if len(sig) > 120:  # long (token ids): compare a digest
        sig = f"{sig[:60]}... (sha256 {hashlib.sha256(sig.encode()).hexdigest()[:16]})"
    views = gather(tp, (local, sig))
    if error is not None:
        raise error
    for rank, (msg, _) in enumerate(views):
        if msg is not None:
            raise RankRefusedError(
                f"rank {rank} refused the {what} ({msg}); rank {tp.rank} refuses it too, so no "
                "rank enters a collective alone"
            )
    sigs = [s for _, s in views]
    if any(s != sigs[0] for s in sigs):
        bad = next(i for i, s in enumerate(sigs) if s != sigs[0])
        raise ValueError(
            f"tensor-parallel ranks disagree on the {what}: rank 0 has {sigs[0]}, rank {bad} has "
            f"{sigs[bad]}; expected every rank to run the same {what}"
        )


@contextmanager
def refuse_together(
    tp: TensorParallel | None, what: str, signature: object = None
) -> Iterator[None]:
    """Run the body's checks on every rank, then ``agree``: an exception on one rank is raised on
    all (see ``agree``) before anyone moves on to a collective."""
    error: BaseException | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised by agree() on this rank
        error = e
    agree(tp, error, what, signature)


def agreed(
    tp: TensorParallel | None, what: str, fn: Callable[[], T], signature: object = None
) -> T:
    """``fn()``, refused on every rank when it raises on one (``refuse_together``)."""
    result: Any = None
    with refuse_together(tp, what, signature):
        result = fn()
    return result


def min_over_ranks(tp: TensorParallel | None, value: int) -> int:
    """The smallest ``value`` over the ranks (e.g. the KV pages every rank can hold)."""
    return value if tp is None or tp.size == 1 else min(gather(tp, value))


__all__ = [
    "RankRefusedError",
    "RowParallelLinear",
    "TensorParallel",
    "agree",
    "agreed",
    "check_ranks_agree",
    "gather",
    "compare_tables",
    "init_tensor_parallel",
    "min_over_ranks",
    "refuse_together",
    "relaunch",
    "require_gpu",
    "shard_specs",
    "shard_tensor",
    "under_torchrun",
]
