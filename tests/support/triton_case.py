"""What the Triton decode tests share: a paged FP8 cache case with its fp32 reference, and
``paged_decode_tma`` run on it.

CPU: Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``, set here before Triton is
imported). Its ``tl.dot`` on bf16 operands returns garbage (numpy has no bf16), so CPU runs take
the products in fp32; the default fp16 products run in the GPU tests. Without Triton, importing
this module skips the importing test module.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Triton reads TRITON_INTERPRET when it is imported and when a kernel is decorated: set it before
if not HAS_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="needs triton (the CPU test venv has none; GPU gate runs it)")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

from torch_kvq.attention.kernels.reference import ref_attention  # noqa: E402
from torch_kvq.spec import FP8_DTYPE  # noqa: E402

K_SCALE, V_SCALE = 1 / 16, 1 / 8
LENS = (1, 15, 16, 17, 1000)


class Case:
    """A paged cache of ``cache_dtype`` with shuffled pages (unused ones hold NaN-free noise),
    queries, and metadata; ``ref()`` is dense fp32 attention on the dequantized cache."""

    def __init__(
        self,
        lens: tuple[int, ...],
        qh: int,
        kh: int,
        d: int,
        page: int = 16,
        cache_dtype: torch.dtype = FP8_DTYPE,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lens, self.qh, self.kh, self.d, self.page = lens, qh, kh, d, page
        n_pages = [max(1, -(-n // page)) for n in lens]
        total = sum(n_pages) + 3  # spare pages: never read
        cache = torch.randn((total, 2, page, kh, d), generator=g) * 8
        self.kv_cache = cache.to(cache_dtype).to(device)
        perm = torch.randperm(total, generator=g)[: sum(n_pages)]
        self.kv_indices = perm.to(torch.int32).to(device)
        indptr = torch.tensor([0, *n_pages]).cumsum(0)
        self.kv_indptr = indptr.to(torch.int32).to(device)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        self.q = (torch.randn((len(lens), qh, d), generator=g) * 2).to(torch.bfloat16).to(device)
        self.sm_scale = d**-0.5

    def ref(self, window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
        outs = []
        for b, n in enumerate(self.lens):
            ids = self.kv_indices[self.kv_indptr[b] : self.kv_indptr[b + 1]].long()
            pages = self.kv_cache[ids].float()
            k = pages[:, 0].reshape(-1, self.kh, self.d)[:n] * K_SCALE
            v = pages[:, 1].reshape(-1, self.kh, self.d)[:n] * V_SCALE
            pos = torch.arange(n, device=k.device)
            qb = self.q[b : b + 1]
            outs.append(ref_attention(qb, k, v, pos[-1:], pos, self.sm_scale, window, soft_cap))
        return torch.cat(outs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def dense_table(case: Case) -> torch.Tensor:
    """The CSR page table as a dense [B, W] block table; padding entries are -1 (never read)."""
    counts = (case.kv_indptr[1:] - case.kv_indptr[:-1]).tolist()
    table = torch.full((len(counts), max(counts)), -1, dtype=torch.int32)
    for b, n in enumerate(counts):
        table[b, :n] = case.kv_indices[case.kv_indptr[b] : case.kv_indptr[b] + n].cpu()
    return table.to(case.kv_indices.device)


def run_tma(case: Case, mod: ModuleType, table: torch.Tensor | None = None, **kw) -> torch.Tensor:
    """``mod.paged_decode_tma`` (the package's ``decode_tma`` or a variant of it) on ``case``."""
    table = dense_table(case) if table is None else table
    return mod.paged_decode_tma(
        case.q, case.kv_cache, table, case.seq_lens,
        K_SCALE, V_SCALE, case.sm_scale, max_seq_len=max(case.lens), **kw,
    )  # fmt: skip


def check_on_gpu(lens: tuple[int, ...], qh: int, kh: int, d: int, cache_dtype: torch.dtype,
                 window: int | None, soft_cap: float | None, **kw) -> None:  # fmt: skip
    """``paged_decode_tma`` with ``kw`` on a CUDA case of ``lens`` against the fp32 reference."""
    from torch_kvq.attention.triton import decode_tma

    case = Case(lens, qh, kh, d, cache_dtype=cache_dtype, device="cuda")
    out = run_tma(case, decode_tma, window=window, soft_cap=soft_cap, **kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-3, f"rel err {err:.2e}"
