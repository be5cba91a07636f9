"""The ``tc4_per_token_head`` decode's Triton program (``triton/decode_tc4.py``) against the
reference: dense fp32 attention over ``quant_tc.dequantize_pages`` of the same cache (k in its
basis, so q is taken as given), one new token per sequence, shuffled pages, several splits, a
sliding window. CPU: under Triton's interpreter (``tests/support/triton_case.py`` sets it);
GPU: compiled (the gate)."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_case import HAS_CUDA  # noqa: F401  (sets TRITON_INTERPRET first)
from torch_kvq.attention import quant_tc
from torch_kvq.attention.kernels.reference import ref_attention
from torch_kvq.attention.quant import hadamard_signs
from torch_kvq.attention.triton.decode_tc4 import paged_decode_tc4
from torch_kvq.attention.triton.decode_tc4_tma import paged_decode_tc4_tma

DEVICE = "cuda" if HAS_CUDA else "cpu"


def _case(lens, kh, g, d, page, seed):
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // page) for n in lens]
    pages = sum(per_seq) + 3
    perm = torch.randperm(pages, generator=gen).tolist()
    k = torch.randn(pages, page, kh, d, generator=gen) * 2
    v = torch.randn(pages, page, kh, d, generator=gen)
    cache, aux = quant_tc.quantize_pages(k, v)
    width = max(per_seq)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = torch.tensor(perm[start : start + n], dtype=torch.int32)
        start += n
    q = torch.randn(len(lens), kh * g, d, generator=gen)
    return q, cache, aux, table, torch.tensor(lens, dtype=torch.int32)


def _reference(q, cache, aux, table, lens, sm_scale, window):
    kv = quant_tc.dequantize_pages(cache, aux)  # [P, 2, page, KH, D]
    out = []
    for i, n in enumerate(lens.tolist()):
        pages = table[i, : -(-n // cache.shape[2])].long()
        k = kv[pages, 0].reshape(-1, *kv.shape[3:])[:n]
        v = kv[pages, 1].reshape(-1, *kv.shape[3:])[:n]
        pos = torch.arange(n)
        out.append(ref_attention(q[i : i + 1], k, v, pos[-1:], pos, sm_scale, window))
    return torch.cat(out)


@pytest.mark.parametrize(
    "lens,kh,g,d,page,splits,window",
    [
        ([1, 17, 40], 2, 4, 64, 16, 1, None),
        ([33, 64, 5], 2, 4, 128, 16, 4, None),
        ([70, 9], 1, 8, 128, 32, 2, 24),
        ([48], 2, 2, 256, 16, 3, None),
    ],
)
@pytest.mark.parametrize("program", ["plain", "tma", "tma-eager"])
def test_program_equals_reference(program, lens, kh, g, d, page, splits, window) -> None:
    q, cache, aux, table, seq_lens = _case(lens, kh, g, d, page, seed=sum(lens) + d)
    want = _reference(q, cache, aux, table, seq_lens, d**-0.5, window)
    dev = [x.to(DEVICE) for x in (q.half(), cache, aux, table, seq_lens)]
    if program == "plain":
        signs = hadamard_signs(d // 2, DEVICE)
        got = paged_decode_tc4(*dev, d**-0.5, signs, num_splits=splits, window=window)
    else:
        lazy = program == "tma"
        got = paged_decode_tc4_tma(
            *dev, d**-0.5, num_splits=splits, window=window, lazy_rescale=lazy
        )
    err = (got.float().cpu() - want).norm() / want.norm()
    assert err < 4e-3, err


def test_tma_program_default_splits() -> None:
    """``num_splits`` None: the split grid's default for the shape (here one split: a split keeps
    at least 64 pages), still the reference's output."""
    q, cache, aux, table, seq_lens = _case([140], 2, 4, 64, 16, seed=5)
    want = _reference(q, cache, aux, table, seq_lens, 64**-0.5, None)
    dev = [x.to(DEVICE) for x in (q.half(), cache, aux, table, seq_lens)]
    got = paged_decode_tc4_tma(*dev, 64**-0.5, max_seq_len=140)
    err = (got.float().cpu() - want).norm() / want.norm()
    assert err < 4e-3, err
