"""The ``tc4_per_token_head`` decode's Triton program (``triton/decode_tc4_tma.py``) against the
reference: dense fp32 attention over
``quant_tc.dequantize_pages`` of the same cache (k in its basis, so q is taken as given), one new
token per sequence, shuffled pages, several splits, a sliding window; and their unpacks, exactly.
CPU: under Triton's interpreter (``tests/support/triton_case.py`` sets it); GPU: compiled, the
same cases (``gpu``: the gate runs them)."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_case import HAS_CUDA  # sets TRITON_INTERPRET first

triton = pytest.importorskip("triton")  # after triton_case, which sets the interpreter first
tl = triton.language
from torch_kvq.attention import quant_tc  # noqa: E402
from torch_kvq.attention.kernels.reference import ref_attention  # noqa: E402
from torch_kvq.attention.triton.decode_tc4_tma import paged_decode_tc4_tma, unpack_k  # noqa: E402
from torch_kvq.attention.triton.fold_logits import fold_tokens  # noqa: E402
from torch_kvq.attention.triton.int4 import unpack_minus  # noqa: E402

# each test on both: the interpreter where there is no GPU, the compiled program where there is one
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="the interpreter: no GPU")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="GPU")]),
]


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
        ([100, 37], 1, 2, 256, 32, 2, 40),  # head 256's pages in steps of 16 tokens
        ([130], 1, 2, 256, 64, 1, None),
        ([200, 70], 2, 4, 128, 64, 2, 90),  # head 128's 64-token pages in one step
        # the folded logits (``fold_tokens`` 2: a row's odd token in the spare columns)
        ([77, 40], 2, 4, 128, 32, 2, 30),
        ([77, 40], 2, 2, 128, 32, 2, None),
        ([50], 2, 1, 128, 32, 1, None),  # one split: the program writes the output
        ([90, 33], 2, 3, 64, 32, 3, None),  # a group of 3: one padded column a fold
        ([1, 2, 33], 1, 4, 128, 32, 4, 1),  # folds and splits with no live token
    ],
)
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
@pytest.mark.parametrize("device", DEVICES)
def test_program_equals_reference(device, lazy, lens, kh, g, d, page, splits, window) -> None:
    q, cache, aux, table, seq_lens = _case(lens, kh, g, d, page, seed=sum(lens) + d)
    want = _reference(q, cache, aux, table, seq_lens, d**-0.5, window)
    dev = [x.to(device) for x in (q.half(), cache, aux, table, seq_lens)]
    got = paged_decode_tc4_tma(*dev, d**-0.5, num_splits=splits, window=window, lazy_rescale=lazy)
    err = (got.float().cpu() - want).norm() / want.norm()
    assert err < 4e-3, err


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d,page", [(64, 16), (128, 16), (128, 32), (128, 64), (256, 32)])
@pytest.mark.parametrize("warps,stages", [(1, 1), (1, 8), (4, 3)])
def test_program_configs(device, d, page, warps, stages) -> None:
    """Every page size at the warps and stages the benchmarks sweep: compiled, the pipeliner
    buffers the four TMA copies by the stage count and the layouts follow the warps (the
    interpreter runs neither; there these cases repeat the pages and heads). Head 64 at 16-token
    pages with 8 stages faulted (misaligned address) before ``bit_box_rows``; head 256 at 32-token
    pages takes them in two steps (``step_tokens``), eight copies a page."""
    lens = [3 * page + 5, page - 1]
    q, cache, aux, table, seq_lens = _case(lens, 2, 4, d, page, seed=page + d)
    want = _reference(q, cache, aux, table, seq_lens, d**-0.5, None)
    dev = [x.to(device) for x in (q.half(), cache, aux, table, seq_lens)]
    got = paged_decode_tc4_tma(*dev, d**-0.5, num_splits=2, num_warps=warps, num_stages=stages)
    err = (got.float().cpu() - want).norm() / want.norm()
    assert err < 4e-3, err


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (128, torch.bfloat16)])
def test_tma_program_default_splits(device, d, dtype) -> None:
    """``num_splits`` None: the split grid's default for the shape (here one split: a split keeps
    at least 64 pages, so the program writes the output itself), still the reference's output, in
    q's dtype (bf16: FlashInferKernel's decode of a bf16 model)."""
    lens = [140] if d == 64 else [16, 17, 201, 78]
    q, cache, aux, table, seq_lens = _case(lens, 2, 4, d, 16, seed=5)
    want = _reference(q, cache, aux, table, seq_lens, d**-0.5, None)
    dev = [x.to(device) for x in (q.to(dtype), cache, aux, table, seq_lens)]
    got = paged_decode_tc4_tma(*dev, d**-0.5, max_seq_len=max(lens))
    assert got.dtype == dtype
    err = (got.float().cpu() - want).norm() / want.norm()
    assert err < 6e-3, err


@triton.jit
def _unpacks(lanes_ptr, bytes_ptr, z_ptr, out_ptr, N: tl.constexpr):
    """Row r (the program) of N x N: ``unpack_k`` of its int16 lanes and ``unpack_minus`` of its
    bytes (zero points z[r], z[N + r]): six fp16 [N, N] tiles at ``out_ptr`` one after another."""
    r = tl.program_id(0)
    i = r * N + tl.arange(0, N)[None, :]  # [1, N]
    a, b, ce, co = unpack_k(tl.load(lanes_ptr + i))
    z_lo = tl.load(z_ptr + r + tl.zeros([1, N], tl.int32))
    z_hi = tl.load(z_ptr + N + r + tl.zeros([1, N], tl.int32))
    v_lo, v_hi = unpack_minus(tl.load(bytes_ptr + i), z_lo, z_hi)
    tl.store(out_ptr + i, a)
    tl.store(out_ptr + N * N + i, b)
    tl.store(out_ptr + 2 * N * N + i, ce)
    tl.store(out_ptr + 3 * N * N + i, co)
    tl.store(out_ptr + 4 * N * N + i, v_lo)
    tl.store(out_ptr + 5 * N * N + i, v_hi)


@pytest.mark.parametrize("device", DEVICES)
def test_unpacks_are_exact(device) -> None:
    """K's lanes to ``1024 + (A, 64 B, 4 C_even, 32 C_odd)`` and V's bytes to (low nibble + 1024
    - z_lo, 16 high nibble + 1024 - z_hi), every bit pattern, exactly (compiled: inline PTX that
    packs two or four values a register; zero points that differ per half and per row)."""
    n = 256
    g = torch.Generator().manual_seed(3)
    lanes = torch.randint(-(2**15), 2**15, (n, n), generator=g, dtype=torch.int32)
    lanes[0] = torch.arange(-(2**15), 2**15, 256)  # high bytes: all of them
    lanes[1] = torch.arange(n)  # low bytes: all of them
    lanes = lanes.to(torch.int16)
    codes = torch.randint(0, 256, (n, n), generator=g, dtype=torch.int32).to(torch.uint8)
    z_lo = 1024 + torch.randint(0, 32, (n,), generator=g).float()
    z_hi = 1024 + 16 * torch.randint(0, 16, (n,), generator=g).float()
    z = torch.cat((z_lo, z_hi)).half()
    out = torch.empty(6, n, n, dtype=torch.float16, device=device)
    _unpacks[(n,)](lanes.to(device), codes.to(device), z.to(device), out, N=n)
    u = lanes.int() & 0xFFFF
    want = torch.stack((
        1024 + (u & 0x3F), 1024 + (u & 0x3C0), 1024 + ((u >> 8) & 0x1C), 1024 + ((u >> 8) & 0xE0),
        1024 + (codes.int() & 0xF) - z_lo[:, None], 1024 + (codes.int() & 0xF0) - z_hi[:, None],
    )).float()  # fmt: skip
    assert torch.equal(out.float().cpu(), want)


def test_fold_tokens_where_the_group_pads_the_mma() -> None:
    """The logits' tile folds a row's second token into the N of 8's spare columns where a
    group of up to 4 heads leaves them and a 32-token step keeps the MMA's 16 rows: head 64 and
    128 at 32-token pages (Llama's 4, Gemma's 2, and 1); not a group of 8, not 16-token steps
    (head 256, 16-token pages), not 64-token ones."""
    assert [fold_tokens(g, 32) for g in (1, 2, 3, 4, 8, 16)] == [2, 2, 2, 2, 1, 1]
    assert fold_tokens(4, 16) == fold_tokens(4, 64) == fold_tokens(2, 16) == 1


def test_default_splits_keep_one_resident_wave() -> None:
    """The split grid aims at ``GRID`` (4) programs per SM, not int4's 8: at 32 x 16k with 8 kv
    heads on 132 SMs 4 splits (1,024 programs, ~7.8 an SM, all resident), which measured faster
    than 8 on an H100 (86.3% of copy against 82.5% at head 128; docs/design/int4-branch.md)."""
    from torch_kvq.attention.triton import decode_tc4_tma as m

    q = torch.zeros(1)  # off CUDA: the H200's 132 SMs
    assert m.GRID == 4
    assert m.default_splits(32, 8, 16384, 32, q) == 4
    assert m.default_splits(32, 8, 16384, 16, q) == 4
    assert m.default_splits(8, 8, 16384, 32, q) == 8  # capped: a split keeps >= 64 pages
    assert m.default_splits(128, 8, 16384, 32, q) == 1
