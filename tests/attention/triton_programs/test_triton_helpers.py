"""The device code and host checks the Triton decode kernels share
(``attention/triton/helpers.py``): the in-register FP8 widening, the split merge (empty splits,
the workspace), the output dtype, and the argument checks. Without Triton every test here skips.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_case import Case, rel_err, run_tma
from torch_kvq.spec_modes import FP8_DTYPE


def test_fp8_widening_is_exact(interp) -> None:
    """Every e4m3 bit pattern (NaN aside) widened in-kernel equals torch's conversion."""
    import triton
    import triton.language as tl

    @triton.jit
    def widen(x_ptr, y_ptr, z_ptr):
        o = tl.arange(0, 256)
        x = tl.load(x_ptr + o)
        tl.store(y_ptr + o, x.to(tl.bfloat16).to(tl.float32))
        tl.store(z_ptr + o, x.to(tl.float16).to(tl.float32))

    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    x = bits.view(FP8_DTYPE)
    y, z = torch.empty(256), torch.empty(256)
    widen[(1,)](x, y, z)
    want = x.float()
    keep = ~want.isnan()
    assert torch.equal(y[keep], want[keep]) and torch.equal(z[keep], want[keep])


def test_bf16_output_bf16_cache_and_empty_splits(interp) -> None:
    """bf16 output (q's dtype, the default), a bf16 cache through the same kernel, and more
    splits than pages (splits with no tokens must drop out of the merge), with and without a
    given workspace."""
    for cache_dtype in (FP8_DTYPE, torch.bfloat16):
        case = Case((1, 17, 40), 8, 2, 64, cache_dtype=cache_dtype, seed=2)
        ws = (torch.empty(3, 8, 8, 64), torch.empty(3, 8, 8))
        for workspace in (None, ws):
            out = run_tma(case, interp, num_splits=8, workspace=workspace, dot_dtype=torch.float32)
            assert out.dtype == torch.bfloat16 and out.shape == case.q.shape
            err = rel_err(out, case.ref())
            assert err < 6e-3, f"{cache_dtype}: rel err {err:.2e}"


def test_argument_checks_name_the_bad_argument() -> None:
    """Host code (runs wherever Triton imports, interpreter or not)."""
    from torch_kvq.attention.triton import helpers

    q = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    lens = torch.ones(2, dtype=torch.int32)
    helpers.check_args("f", q, dict(seq_lens=lens), dict(dot_dtype=torch.float16), 4)
    with pytest.raises(ValueError, match="f: seq_lens must be int32 on cpu, got torch.int64"):
        helpers.check_args("f", q, dict(seq_lens=lens.long()), {}, None)
    with pytest.raises(ValueError, match="f: dot_dtype must be one of"):
        helpers.check_args("f", q, {}, dict(dot_dtype=torch.int8), None)
    with pytest.raises(ValueError, match="f: window must be positive, got 0"):
        helpers.check_args("f", q, {}, {}, 0)
    out, part_o, part_lse = helpers.split_outputs("f", q, None, 3, None)
    assert out.dtype == torch.bfloat16 and part_o.shape == (2, 8, 3, 64)
    assert part_lse.shape == (2, 8, 3) and part_lse.dtype == torch.float32
    with pytest.raises(ValueError, match=r"f: workspace shapes .* need \(2, 8, 3, 64\)"):
        helpers.split_outputs("f", q, None, 3, (part_o[:1], part_lse[:1]))
    with pytest.raises(ValueError, match=r"f: out must be \(2, 8, 64\)"):
        helpers.split_outputs("f", q, torch.empty(2, 8, 32), 1, None)
