"""Split-K GEMMs for the decode step's skinny projections.

A decode step's projection is ``x [M, K] @ W [N, K]^T`` with M = the batch (tens of rows): reading
W is the whole cost, and a GEMM of ~10-60 us pays a few microseconds of launch, ramp and tail.
cuBLAS splits K for some shapes and then sums the splits in a kernel of its own
(``splitKreduce_kernel``, ~2 us, twice per Gemma-3-12B layer at batch 32: H200 runs 45 and 47).

``kvq_models::splitk_partials`` gives every (N tile, K split) a program and returns the fp32
partial products ``[splits, M, N]``; ``SplitKLinear`` sums them (``.sum(0)``). Under torch.compile
that sum is no kernel of its own: Inductor unrolls a reduction of at most 8
(``unroll_reductions_threshold``) into pointwise code inside the kernel that reads the projection
(the residual add, the norm, the activation)::

    before:  y = aten.mm(x, W^T)                                  # cuBLAS (+ its reduce kernel)
    after:   p = kvq_models.splitk_partials(x, W, 4, 64, 128, 4)   # [4, M, N] fp32
             y = (p[0] + p[1] + p[2] + p[3]).to(bf16)              # inside the consumer's kernel

Rows above ``SplitKConfig.max_rows`` (prefill) take ``F.linear``: a prefill graph is traced with
its own row count, so the choice is made while tracing (a guard on the row count). On CPU the op
computes the same split partials with torch (the reference, for tests); on CUDA it is the Triton
kernel of ``splitk_kernel`` and raises if Triton is missing. The op is outside the ``kvq``
namespace on purpose: the passes read every ``kvq::`` op as a KV-cache op of some layer.

    use_split_k(model, {"o_proj": SplitKConfig(splits=4)})   # every layer's o_proj
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Inductor unrolls reductions up to this size into pointwise code (unroll_reductions_threshold)
MAX_SPLITS = 8


@dataclasses.dataclass(frozen=True)
class SplitKConfig:
    """One projection's split-K GEMM: ``splits`` programs per ``block_n`` output columns, each over
    ``ceil(K / block_k / splits)`` tiles of ``block_k``, ``stages`` loads in flight; batches of at
    most ``max_rows`` rows take it, larger ones ``F.linear``."""

    splits: int
    block_n: int = 64
    block_k: int = 128
    stages: int = 4
    max_rows: int = 128

    def __post_init__(self) -> None:
        for name in ("splits", "block_n", "block_k", "stages", "max_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SplitKConfig.{name} must be a positive int, got {v!r}")
        if self.splits > MAX_SPLITS:
            raise ValueError(
                f"SplitKConfig.splits {self.splits} > {MAX_SPLITS}: Inductor fuses the sum of at "
                f"most {MAX_SPLITS} partials into the next kernel"
            )
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"SplitKConfig.{name} must be a power of 2 >= 16, got {v}")


def split_bounds(k: int, splits: int, block_k: int) -> list[tuple[int, int]]:
    """The K range of each split, as the kernel cuts it: whole ``block_k`` tiles, the last splits
    short or empty."""
    tiles = -(-k // block_k)
    per = -(-tiles // splits) * block_k
    return [(min(s * per, k), min((s + 1) * per, k)) for s in range(splits)]


def _check_args(x: Tensor, w: Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"splitk_partials takes x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(
            f"x and w must share dtype and device, got {x.dtype} on {x.device} and {w.dtype} on "
            f"{w.device}"
        )
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(
            f"x and w need contiguous rows (stride 1 along K), got strides {x.stride()} and "
            f"{w.stride()}"
        )


@torch.library.custom_op("kvq_models::splitk_partials", mutates_args=())
def splitk_partials(
    x: Tensor, w: Tensor, splits: int, block_n: int, block_k: int, stages: int
) -> Tensor:
    """x [M, K], w [N, K] -> fp32 [splits, M, N]: split s holds x[:, a:b] @ w[:, a:b]^T over its K
    range (``split_bounds``); their sum is ``x @ w^T``."""
    _check_args(x, w)
    if x.is_cuda:
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError(
                "kvq_models::splitk_partials on CUDA needs Triton (pip install triton); it is not "
                "installed"
            )
        from torch_kvq.models.splitk_kernel import splitk_partials_triton

        return splitk_partials_triton(x, w, splits, block_n, block_k, stages)
    parts = [
        F.linear(x[:, a:b].float(), w[:, a:b].float())
        for a, b in split_bounds(x.shape[1], splits, block_k)
    ]
    return torch.stack(parts)


@splitk_partials.register_fake
def _(x: Tensor, w: Tensor, splits: int, block_n: int, block_k: int, stages: int) -> Tensor:
    return x.new_empty((splits, x.shape[0], w.shape[0]), dtype=torch.float32)


class SplitKLinear(nn.Module):
    """An ``nn.Linear``'s weight and bias (the same parameters) through ``splitk_partials`` for
    batches of up to ``config.max_rows`` rows. forward(x [T, in]) -> [T, out] in x's dtype."""

    def __init__(self, linear: nn.Linear, config: SplitKConfig) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.config = config

    def forward(self, x: Tensor) -> Tensor:
        c = self.config
        if x.dim() != 2 or x.shape[0] > c.max_rows:
            return F.linear(x, self.weight, self.bias)
        y = splitk_partials(x, self.weight, c.splits, c.block_n, c.block_k, c.stages).sum(0)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.config}"


def use_split_k(model: nn.Module, configs: Mapping[str, SplitKConfig]) -> int:
    """Replace every ``nn.Linear`` named a key of ``configs`` (the attribute name: ``"o_proj"``,
    ``"qkv_proj"``, ``"down_proj"``, ...) by a ``SplitKLinear`` with that config; returns how many.
    Fuse projections first (``fuse_projections()``) to split the fused GEMMs. Raises for a name
    that matches no plain ``nn.Linear`` (a tensor-parallel shard all-reduces: not supported)."""
    found: dict[str, int] = dict.fromkeys(configs, 0)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name not in configs:
                continue
            if type(child) is not nn.Linear:
                raise ValueError(
                    f"{name} is a {type(child).__name__}, expected a plain nn.Linear (split-K "
                    "GEMMs do not serve tensor-parallel shards)"
                )
            setattr(parent, name, SplitKLinear(child, configs[name]))
            found[name] += 1
    missing = sorted(n for n, count in found.items() if count == 0)
    if missing:
        names = sorted(
            {n for m in model.modules() for n, c in m.named_children() if isinstance(c, nn.Linear)}
        )
        raise ValueError(f"no nn.Linear named {missing} in the model; its linear layers: {names}")
    return sum(found.values())
