"""The ``int4_per_token_head`` cache write's Triton program (``kv_write_int4_kernel``, launched by
``kernels/kv_write_int4.py``) against the aten write (``write_kv_per_token_head_torch``).

CPU: the rounding the program uses (``clamp(floor(y) + (y - floor(y) >= 0.5), 0, 15)`` for
``clamp(round_half_away(y), 0, 15)``) checked on a dense grid around every half-integer in
[-1, 16.5] and on random values; with Triton installed, the program under the interpreter
against the aten write, bit for bit (codes and scales viewed as int32), over head sizes (powers of
two, 96 with rotation blocks of 32, small even sizes), kv heads, page sizes, batch sizes, input
dtypes, shuffled slots, strided k / v and rows that hit the edges (zeros, equal values, an
outlier, huge and tiny magnitudes). ``k8v4_per_token_head`` (k int8 as bytes in slots 0 / 1, v
int4 in slot 2): the int8 program for k and this one for v, bit for bit against its aten write.
GPU: the compiled programs against aten on the device.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from torch_kvq.attention import quant
from torch_kvq.attention.kernels import kv_write, kv_write_int4, kv_write_per_token_head
from torch_kvq.attention.kernels.kv_write_per_token_head import (
    write_kv_per_token_head,
    write_kv_per_token_head_torch,
)

HAS_CUDA = torch.cuda.is_available()


# -- the rounding -----------------------------------------------------------------------------------


def _floor_frac_form(y: torch.Tensor) -> torch.Tensor:
    """``clamp(floor(y) + (y - floor(y) >= 0.5), 0, 15)``."""
    f = torch.floor(y)
    return (f + torch.where(y - f >= 0.5, 1.0, 0.0)).clamp(0, 15)


def _program_form(y: torch.Tensor) -> torch.Tensor:
    """The program's ``_round_clamp15`` in the same fp32 operations: ``clamp(floor(y +
    0.49999997), 0, 15)``, 0.49999997 being fp32 0.5 - 2^-25."""
    return torch.floor(y + torch.tensor(0.5 - 2.0**-25)).clamp(0, 15)


def _neighbours(y: torch.Tensor, steps: int) -> torch.Tensor:
    """y and its ``steps`` nearest fp32 neighbours on each side."""
    out, up, down = [y], y, y
    for _ in range(steps):
        up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
        out += [up, down]
    return torch.cat(out)


def _grid() -> torch.Tensor:
    halves = torch.arange(-2, 34, dtype=torch.float32) / 2  # -1, -0.5, .., 16.5
    g = torch.Generator().manual_seed(0)
    rand = [torch.rand(200_000, generator=g) * 19 - 1.5,  # [-1.5, 17.5]
            torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=g, dtype=torch.int64)
            .to(torch.int32).view(torch.float32)]  # fmt: skip  # any fp32 bit pattern
    special = torch.tensor([0.0, -0.0, 0.49999997, 14.499999, 15.5, 1e30, -1e30, 2.0**23 + 1,
                            float("inf"), float("-inf")])  # fmt: skip
    y = torch.cat([_neighbours(halves, 1 << 12), *rand, special])
    return y[~y.isnan()]


def test_floor_forms_are_round_half_away_clamped() -> None:
    """Both forms equal ``clamp(round_half_away(y), 0, 15)`` where they could differ: within 4096
    ulps of every half-integer in [-1, 16.5] (a sum y + 0.49999997 rounds up across an integer
    only within a few ulps of one; below 0 every form gives 0 and past 16.5 every form 15), and
    on random values and bit patterns. (Every fp32 in [-1, 16.5] was checked once, offline.)"""
    y = _grid()
    assert y.numel() > 500_000
    want = quant.round_half_away(y).clamp(0, 15)
    assert torch.equal(_floor_frac_form(y), want)
    assert torch.equal(_program_form(y), want)
    # the plain floor(y + 0.5) is not: 0.5 - 2^-25 + 0.5 rounds to 1
    assert _program_form(torch.tensor([0.5 - 2.0**-25])).item() == 0.0
    assert torch.floor(torch.tensor([0.5 - 2.0**-25]) + 0.5).item() == 1.0


# -- the Triton program under the interpreter (CPU, needs Triton) ---------------------------------

if importlib.util.find_spec("triton") is not None and not HAS_CUDA:
    # as tests/support/triton_case.py: the interpreter flag goes in before Triton is imported
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETING or importlib.util.find_spec("triton") is None,
    reason="needs Triton's interpreter (Triton installed, no CUDA); the GPU tests run the program",
)


def _kv(t: int, kh: int, d: int, dtype: torch.dtype, g: torch.Generator, device: str = "cpu",
        layout: str = "fused") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """k and v [T, KH, D]: views of one fused qkv output (``"fused"``: strided along T), or with
    the head and channel dims swapped in memory (``"transposed"``: channel stride KH)."""
    if layout == "fused":
        wide = (torch.randn(t, 3 * kh * d, generator=g) * 4).to(dtype).to(device)
        return wide[:, : kh * d].view(t, kh, d), wide[:, 2 * kh * d :].view(t, kh, d)
    kv = (torch.randn(2, t, d, kh, generator=g) * 4).to(dtype).to(device)
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)


def _edge_rows(k: torch.Tensor, v: torch.Tensor, g: torch.Generator) -> None:
    """Rows at the format's edges, spread over tokens and heads (as many as the batch holds)."""
    t, kh, d = k.shape
    if t == 0:
        return
    rows = [(i % t, (3 * i) % kh) for i in range(7)]
    dt = k.dtype
    k[rows[0]] = 0  # zero: the scale floor, codes 0
    v[rows[1]] = 3.0  # equal values
    spike = torch.randn(d, generator=g) * 0.01
    spike[d // 3] = 50.0  # one outlier: clipping pays
    k[rows[2]] = spike.to(dt)
    v[rows[3]] = (torch.randn(d, generator=g).clamp(-4, 4) * 1e4).to(dt)  # huge (fp16 holds it)
    k[rows[4]] = (torch.randn(d, generator=g) * 1e-8).to(dt)  # tiny: the floor at every ratio
    v[rows[5]] = -2.5  # equal and negative
    k[rows[6]] = (torch.arange(d, dtype=torch.float32) % 7 - 3).to(dt)  # small integers


def _case(t, kh, d, page, dtype, seed, device="cpu", layout="fused", slot_dtype=torch.int64,
          mode="int4"):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    pages = max(2, -(-2 * t // page))  # room to shuffle the slots
    slots_dim = quant.cache_layout(mode)[1]  # k8v4: 3 (k's int8 bytes in two slots, v's codes)
    cache = torch.randint(0, 256, (pages, slots_dim, page, kh, d // 2), generator=g,
                          dtype=torch.uint8)  # fmt: skip
    scale = torch.rand(pages, 2, kh, page, generator=g) + 0.5
    k, v = _kv(t, kh, d, dtype, g, layout=layout)
    _edge_rows(k, v, g)
    slots = torch.randperm(pages * page, generator=g)[:t].to(slot_dtype)
    return cache.to(device), scale.to(device), k.to(device), v.to(device), slots.to(device)


def _check(cache, scale, k, v, slots, mode="int4", rounding="half_away") -> None:
    want_c, want_s = cache.clone(), scale.clone()
    write_kv_per_token_head_torch(want_c, want_s, k, v, slots.long(), mode, rounding)
    kv_write_per_token_head.write_kv_per_token_head_triton(
        cache, scale, k, v, slots, mode, rounding
    )
    assert torch.equal(scale.view(torch.int32), want_s.view(torch.int32))
    assert torch.equal(cache, want_c)


# (T, KH, D, page, dtype, k / v layout): every D, KH, page size, T and dtype of the plan at least
# once, D = 128 and 64 against each dtype
INTERPRETER_CASES = [
    (33, 8, 128, 16, torch.bfloat16, "fused"),
    (5, 2, 64, 16, torch.float16, "fused"),
    (5, 3, 96, 1, torch.bfloat16, "fused"),  # D = 96: three rotation blocks of 32
    (33, 1, 96, 32, torch.float32, "transposed"),
    (1, 8, 256, 32, torch.float16, "fused"),
    (5, 2, 256, 1, torch.float32, "transposed"),
    (33, 3, 6, 16, torch.bfloat16, "fused"),  # blocks of 2, padded to 8
    (5, 8, 10, 32, torch.float16, "transposed"),  # blocks of 2, padded to 16
    (33, 2, 64, 1, torch.float32, "fused"),
    (1, 1, 128, 16, torch.float32, "transposed"),
    (5, 8, 64, 16, torch.bfloat16, "transposed"),
]


@pytest.fixture(params=["channels_first", "rows_first"])
def variant(request, monkeypatch) -> str:
    """Either tile of the program, whatever the batch size would pick (``ROWS_FIRST``)."""
    below = 0 if request.param == "channels_first" else 1 << 30
    monkeypatch.setattr(kv_write_int4, "INT4_ROWS_FIRST_BELOW", below)
    return request.param


@needs_interpreter
@pytest.mark.parametrize("t,kh,d,page,dtype,layout", INTERPRETER_CASES)
def test_interpreter_program_equals_aten(variant, t, kh, d, page, dtype, layout) -> None:
    _check(*_case(t, kh, d, page, dtype, seed=t * kh + d, layout=layout,
                  slot_dtype=torch.int32 if kh % 2 else torch.int64))  # fmt: skip


# k8v4_per_token_head (k int8 as bytes in slots 0 / 1, v int4 in slot 2): its two launches
K8V4_CASES = [
    (33, 8, 128, 16, torch.bfloat16, "fused", "half_away"),
    (5, 3, 96, 1, torch.float16, "transposed", "half_even"),
    (1, 2, 256, 32, torch.float32, "fused", "half_even"),
    (5, 8, 10, 16, torch.bfloat16, "transposed", "half_away"),
]


@needs_interpreter
@pytest.mark.parametrize("t,kh,d,page,dtype,layout,rounding", K8V4_CASES)
def test_interpreter_k8v4_programs_equal_aten(variant, t, kh, d, page, dtype, layout, rounding):
    """k's int8 codes and scale by the int8 program (``SPLIT_K``), v's int4 codes and scale by
    the int4 one (``v_only``), every byte and scale as the aten write's, the rest untouched."""
    _check(*_case(t, kh, d, page, dtype, seed=t + d, layout=layout, mode="k8v4"), "k8v4",
           rounding)  # fmt: skip


@needs_interpreter
def test_interpreter_tiles_end_mid_token(monkeypatch) -> None:
    """Rows (token, head) tile the programs without regard to tokens: with 3 heads and 4 rows a
    program, a token's heads straddle two programs."""
    monkeypatch.setattr(kv_write_int4, "INT4_ROWS", 4)
    _check(*_case(11, 3, 64, 16, torch.bfloat16, seed=7))


@needs_interpreter
def test_interpreter_empty_batch_writes_nothing() -> None:
    cache, scale, k, v, slots = _case(0, 2, 64, 16, torch.bfloat16, seed=0)
    before = cache.clone(), scale.clone()
    kv_write_per_token_head.write_kv_per_token_head_triton(cache, scale, k, v, slots, "int4")
    assert torch.equal(cache, before[0]) and torch.equal(scale, before[1])


@needs_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf
def test_interpreter_rounding_helper_is_the_floor_form() -> None:
    """``_round_clamp15`` itself, under the interpreter, on the rounding grid."""
    import triton
    import triton.language as tl

    from torch_kvq.attention.triton import kv_write as programs

    @triton.jit
    def apply(x_ptr, y_ptr, n, FN: tl.constexpr, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + o, FN(tl.load(x_ptr + o, mask=o < n)), mask=o < n)

    y = _grid()
    out = torch.empty_like(y)
    grid = (triton.cdiv(y.numel(), 1 << 16),)
    apply[grid](y, out, y.numel(), FN=programs._round_clamp15, BLOCK=1 << 16)
    assert torch.equal(out, quant.round_half_away(y).clamp(0, 15))


# -- GPU: the compiled program against aten on the device -----------------------------------------

needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (Triton program)")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kh,d,page", [(8, 128, 16), (8, 256, 16), (1, 64, 1), (3, 96, 32),
                                       (2, 10, 16)])  # fmt: skip
@pytest.mark.parametrize("layout", ["fused", "transposed"])
def test_gpu_write_equals_aten(variant, dtype, kh, d, page, layout) -> None:
    """``write_kv_per_token_head`` on a CUDA cache (the Triton program) against the aten write
    on the same device, 300 tokens with the edge rows."""
    cache, scale, k, v, slots = _case(300, kh, d, page, dtype, seed=d + kh, device="cuda",
                                      layout=layout)  # fmt: skip
    want_c, want_s = cache.clone(), scale.clone()
    write_kv_per_token_head_torch(want_c, want_s, k, v, slots, "int4")
    write_kv_per_token_head(cache, scale, k, v, slots.to(torch.int32), "int4")
    assert torch.equal(scale.view(torch.int32), want_s.view(torch.int32))
    assert torch.equal(cache, want_c)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kh,d,page", [(8, 128, 16), (8, 256, 16), (1, 64, 1), (3, 96, 32),
                                       (2, 10, 16)])  # fmt: skip
@pytest.mark.parametrize("rounding", ["half_away", "half_even"])
def test_gpu_k8v4_write_equals_aten(variant, dtype, kh, d, page, rounding) -> None:
    """A k8v4 cache on the GPU: k by the int8 program, v by the int4 one, against aten on the
    device (300 tokens with the edge rows)."""
    cache, scale, k, v, slots = _case(300, kh, d, page, dtype, seed=d + kh, device="cuda",
                                      mode="k8v4")  # fmt: skip
    want_c, want_s = cache.clone(), scale.clone()
    write_kv_per_token_head_torch(want_c, want_s, k, v, slots, "k8v4", rounding)
    write_kv_per_token_head(cache, scale, k, v, slots.to(torch.int32), "k8v4", rounding)
    assert torch.equal(scale.view(torch.int32), want_s.view(torch.int32))
    assert torch.equal(cache, want_c)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_many_rows_equal_aten(variant, d: int) -> None:
    """A prefill-sized batch (16k tokens x 8 heads of k and of v): rare ratio ties and roundings
    would show here."""
    cache, scale, k, v, slots = _case(16384, 8, d, 16, torch.bfloat16, seed=d, device="cuda")
    k[::5] = (k[::5].float() * 0.37).to(k.dtype)  # more scales, more rounding cases
    want_c, want_s = cache.clone(), scale.clone()
    write_kv_per_token_head_torch(want_c, want_s, k, v, slots, "int4")
    write_kv_per_token_head(cache, scale, k, v, slots, "int4")
    assert torch.equal(scale.view(torch.int32), want_s.view(torch.int32))
    assert torch.equal(cache, want_c)


@pytest.mark.gpu
@needs_gpu
def test_gpu_program_has_no_fused_multiply_add() -> None:
    """The launch turns fp fusion off: no fma in the PTX (ptxas gets --fmad=false as well)."""
    cache, scale, k, v, slots = _case(64, 8, 128, 16, torch.bfloat16, seed=1, device="cuda")
    program = kv_write.write_program("kv_write_int4_kernel")
    handle = kv_write_int4.launch_int4_write(program, cache, scale, k, v, slots)
    ptx = handle.asm["ptx"]
    assert "fma.rn.f32" not in ptx and "fma.rn.f64" not in ptx


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["int4", "k8v4"])
def test_gpu_int4_write_captures_in_a_cuda_graph(mode: str) -> None:
    cache, scale, k, v, slots = _case(32, 8, 128, 16, torch.bfloat16, seed=9, device="cuda",
                                      mode=mode)  # fmt: skip
    write_kv_per_token_head(cache.clone(), scale.clone(), k, v, slots, mode)  # probes, compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv_per_token_head(cache, scale, k, v, slots, mode)
    k.mul_(3)
    v.mul_(0.5)
    slots.copy_(slots.flip(0))
    graph.replay()
    want_c, want_s = cache.clone(), scale.clone()
    write_kv_per_token_head_torch(want_c, want_s, k, v, slots, mode)
    assert torch.equal(scale.view(torch.int32), want_s.view(torch.int32))
    assert torch.equal(cache, want_c)
