"""What the Triton decode tests share: a paged FP8 cache case (per tensor, ``Case``, or per
(token, head), ``ScaledCase``) with its fp32 reference, and ``paged_decode_tma`` run on it.

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
from torch_kvq.attention.quant import (  # noqa: E402
    dequantize_pages_per_token_head,
    quantize_pages_per_token_head,
)
from torch_kvq.spec_modes import FP8_DTYPE  # noqa: E402

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
        self.k_scale, self.v_scale, self.kv_scale = K_SCALE, V_SCALE, None

    def pages(self, ids: torch.Tensor) -> torch.Tensor:
        """Pages ``ids`` dequantized: [n, 2, page, KH, D] fp32."""
        scales = torch.tensor([K_SCALE, V_SCALE], device=self.kv_cache.device)
        return self.kv_cache[ids].float() * scales.view(2, 1, 1, 1)

    def ref(self, window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
        outs = []
        for b, n in enumerate(self.lens):
            ids = self.kv_indices[self.kv_indptr[b] : self.kv_indptr[b + 1]].long()
            pages = self.pages(ids)
            k = pages[:, 0].reshape(-1, self.kh, self.d)[:n]
            v = pages[:, 1].reshape(-1, self.kh, self.d)[:n]
            pos = torch.arange(n, device=k.device)
            qb = self.q[b : b + 1]
            outs.append(ref_attention(qb, k, v, pos[-1:], pos, self.sm_scale, window, soft_cap))
        return torch.cat(outs)


class ScaledCase(Case):
    """``Case`` with a per-(token, head) cache: the same shuffled pages of model-dtype values
    (N(0, 1) times ``k_gain`` / ``v_gain``) quantized as a cache holds them (``mode`` "int8" |
    "fp8" | "int4" | "k8v4", ``quant.quantize_pages_per_token_head``): codes in ``kv_cache``,
    scales in ``kv_scale`` [P, 2, KH, page]; int4: packed codes [..., D / 2] uint8, rotated, v's
    in ``v_layout``'s positions, the reference on the cache dequantized and un-rotated; k8v4: k
    int8 in slots 0 / 1, v int4 in slot 2."""

    def __init__(self, lens: tuple[int, ...], qh: int, kh: int, d: int, mode: str = "int8",
                 page: int = 16, device: str = "cpu", seed: int = 0, k_gain: float = 1.0,
                 v_gain: float = 1.0) -> None:  # fmt: skip
        super().__init__(lens, qh, kh, d, page, torch.float32, "cpu", seed)
        real = self.kv_cache / 8 * torch.tensor([k_gain, v_gain]).view(2, 1, 1, 1)
        codes, scales = quantize_pages_per_token_head(real.to(torch.bfloat16), mode)
        self.kv_cache = codes.to(device)
        self.kv_scale = scales.transpose(-1, -2).contiguous().to(device)  # [P, 2, KH, page]
        self.kv_indices, self.kv_indptr = self.kv_indices.to(device), self.kv_indptr.to(device)
        self.seq_lens, self.q = self.seq_lens.to(device), self.q.to(device)
        self.k_scale = self.v_scale = 1.0

    def pages(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kv_cache.dtype == torch.uint8:  # int4 / k8v4: v un-rotated (the model's basis)
            return dequantize_pages_per_token_head(self.kv_cache, self.kv_scale, ids, torch.float32)
        return self.kv_cache[ids].float() * self.kv_scale[ids].transpose(-1, -2)[..., None]


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
    if case.kv_scale is not None:
        kw.setdefault("kv_scale", case.kv_scale)
    return mod.paged_decode_tma(
        case.q, case.kv_cache, table, case.seq_lens,
        case.k_scale, case.v_scale, case.sm_scale, max_seq_len=max(case.lens), **kw,
    )  # fmt: skip


def check_on_gpu(lens: tuple[int, ...], qh: int, kh: int, d: int, cache_dtype: torch.dtype | str,
                 window: int | None, soft_cap: float | None, **kw) -> None:  # fmt: skip
    """``paged_decode_tma`` with ``kw`` on a CUDA case of ``lens`` against the fp32 reference;
    ``cache_dtype`` "int8" / "fp8" (a string): a per-(token, head) ``ScaledCase``."""
    from torch_kvq.attention.triton import decode_tma

    if isinstance(cache_dtype, str):
        case: Case = ScaledCase(lens, qh, kh, d, cache_dtype, device="cuda")
    else:
        case = Case(lens, qh, kh, d, cache_dtype=cache_dtype, device="cuda")
    out = run_tma(case, decode_tma, window=window, soft_cap=soft_cap, **kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-3, f"rel err {err:.2e}"
