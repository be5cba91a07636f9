"""The ``tc4_per_token_head`` cache write's Triton program (``kv_write_tc_kernel``, launched by
``kernels/kv_write_tc.py``) against the aten write (``write_kv_tc_torch``: ``quant_tc``'s math).

CPU: the program's rounding (``clamp(floor(y + 0.49999997), 0, L)`` for ``clamp(round_half_away(
y), 0, L)``) on a dense grid around every half-integer up to 64.5 (the 6-bit group's 63 steps);
with Triton installed, the program under the interpreter against the aten write, byte for byte
(code rows and side rows), over head sizes 64 / 128 / 256, kv heads, page sizes, input dtypes,
shuffled slots, strided k / v and rows at the format's edges; a head size the program does not
take is refused. GPU: the compiled program against aten on the device (the gate).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from torch_kvq.attention import quant, quant_tc
from torch_kvq.attention.kernels import kv_write_tc
from torch_kvq.attention.kernels.base import KernelUnsupportedError
from torch_kvq.spec_modes import tc4_aux_width

HAS_CUDA = torch.cuda.is_available()


def _program_form(y: torch.Tensor, levels: int) -> torch.Tensor:
    return torch.floor(y + torch.tensor(0.5 - 2.0**-25)).clamp(0, levels)


@pytest.mark.parametrize("levels", [7, 15, 31, 63])
def test_the_programs_rounding_is_round_half_away_then_clamp(levels: int) -> None:
    halves = torch.arange(-2, 2 * levels + 3, dtype=torch.float32) / 2
    ys = [halves]
    up = down = halves
    for _ in range(64):  # each half-integer's 64 nearest fp32 neighbours on each side
        up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
        ys += [up, down]
    g = torch.Generator().manual_seed(levels)
    ys.append(torch.rand(200_000, generator=g) * (levels + 3) - 1.5)
    y = torch.cat(ys)
    want = quant.round_half_away(y).clamp(0, levels)
    assert torch.equal(_program_form(y, levels), want)


@pytest.mark.parametrize("t,kh,d,page", [(5, 2, 64, 16), (3, 3, 128, 32), (4, 2, 32, 4)])
def test_aten_write_reads_back_as_each_rows_round_trip(t, kh, d, page) -> None:
    """The aten write puts each row where ``quant_tc.dequantize_pages`` reads it (v's bytes in
    ``v_layout``'s positions where it applies, the aux records in their blocks)."""
    cache, aux, k, v, slots = _case(t, kh, d, page, torch.float32, seed=d + page)
    kv_write_tc.write_kv_tc_torch(cache, aux, k, v, slots.long())
    kv = quant_tc.dequantize_pages(cache, aux)
    pages, offsets = slots // page, slots % page
    assert torch.equal(kv[pages, 0, offsets], quant_tc.dequantize_k(*quant_tc.quantize_k(k)))
    assert torch.equal(kv[pages, 1, offsets], quant_tc.dequantize_v(*quant_tc.quantize_v(v)))


# -- the Triton program under the interpreter (CPU, needs Triton) ---------------------------------

if importlib.util.find_spec("triton") is not None and not HAS_CUDA:
    if "triton" not in sys.modules:  # the interpreter flag goes in before Triton is imported
        os.environ["TRITON_INTERPRET"] = "1"
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETING or importlib.util.find_spec("triton") is None,
    reason="needs Triton's interpreter (Triton installed, no CUDA); the GPU tests run the program",
)


def _case(t, kh, d, page, dtype, seed, layout="fused", device="cpu"):
    g = torch.Generator().manual_seed(seed)
    pages = max(2, -(-2 * t // page))
    cache = torch.randint(0, 256, (pages, 2, page, kh, d // 2), generator=g, dtype=torch.uint8)
    aux = torch.randint(0, 256, (pages, kh, tc4_aux_width(d), page), generator=g,
                        dtype=torch.uint8)  # fmt: skip
    if layout == "fused":  # views of one qkv output, strided along T
        wide = (torch.randn(t, 3 * kh * d, generator=g) * 4).to(dtype)
        k, v = wide[:, : kh * d].view(t, kh, d), wide[:, 2 * kh * d :].view(t, kh, d)
    else:  # channel stride KH
        kv = (torch.randn(2, t, d, kh, generator=g) * 4).to(dtype)
        k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
    if t:  # rows at the format's edges
        k[0, 0] = 0  # zero: the scale floor
        v[0, kh - 1] = 3.0  # equal values
        spike = torch.randn(d, generator=g) * 0.01
        spike[d // 3] = 50.0  # one outlier: clipping pays
        k[t // 2, kh // 2] = spike.to(dtype)
        v[t - 1, 0] = (torch.randn(d, generator=g) * 1e-8).to(dtype)  # tiny: the fp16 floor
        k[t - 1, kh - 1] = (torch.arange(d, dtype=torch.float32) % 7 - 3).to(dtype)
    slots = torch.randperm(pages * page, generator=g)[:t]
    return cache.to(device), aux.to(device), k.to(device), v.to(device), slots.to(device)


def _check(cache, aux, k, v, slots) -> None:
    want_c, want_a = cache.clone(), aux.clone()
    kv_write_tc.write_kv_tc_torch(want_c, want_a, k, v, slots.long())
    kv_write_tc.write_kv_tc_triton(cache, aux, k, v, slots)
    assert torch.equal(aux, want_a)
    assert torch.equal(cache, want_c)


CASES = [
    (5, 2, 64, 16, torch.bfloat16, "fused"),
    (3, 3, 128, 32, torch.float16, "transposed"),
    (2, 2, 256, 16, torch.float32, "fused"),
    (7, 1, 128, 1, torch.bfloat16, "transposed"),
    (9, 2, 128, 64, torch.bfloat16, "fused"),  # 64-token pages (head 128's candidate)
]


@needs_interpreter
@pytest.mark.parametrize("t,kh,d,page,dtype,layout", CASES)
def test_interpreter_program_equals_aten(t, kh, d, page, dtype, layout) -> None:
    _check(*_case(t, kh, d, page, dtype, seed=t * kh + d, layout=layout))


@needs_interpreter
def test_interpreter_refuses_a_head_size_it_does_not_take() -> None:
    cache, aux, k, v, slots = _case(2, 1, 96, 16, torch.bfloat16, seed=0)
    with pytest.raises(KernelUnsupportedError, match="head sizes \\(64, 128, 256\\), got 96"):
        kv_write_tc.write_kv_tc_triton(cache, aux, k, v, slots)


def test_program_refuses_aux_blocks_that_are_not_contiguous() -> None:
    """Its records' fp16 slots are two adjacent bytes: a strided aux is refused before launch,
    nothing written."""
    cache, aux, k, v, slots = _case(2, 1, 64, 16, torch.float32, seed=0)
    wide = torch.zeros(*aux.shape[:-1], 2 * aux.shape[-1], dtype=torch.uint8)[..., ::2]
    with pytest.raises(ValueError, match=r"aux block contiguous \(strides \[\.\.\., 16, 1\]\)"):
        kv_write_tc.write_kv_tc_triton(cache, wide, k, v, slots)
    assert not wide.any()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("t,kh,d,page,dtype,layout", CASES + [(64, 8, 128, 32, torch.bfloat16,
                                                                "fused")])  # fmt: skip
def test_gpu_program_equals_aten(t, kh, d, page, dtype, layout) -> None:
    _check(*_case(t, kh, d, page, dtype, seed=t * kh + d, layout=layout, device="cuda"))
