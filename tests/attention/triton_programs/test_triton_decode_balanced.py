"""The TMA decode kernel's balanced schedule (``attention/triton/decode_balanced.py``) against
the reference.

CPU: Triton's interpreter with fp32 products, the program count forced from 1 (one program
reads every pair) to more programs than pages (some read nothing), so that runs cut pairs at
every place; GPU: the compiled kernel under the gate, in a CUDA graph whose lengths change, and
chosen by ``paged_decode_tma`` itself at a batch where ``BALANCED`` applies. Without Triton every
test here skips.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.support.triton_case import (
    HAS_CUDA,
    Case,
    check_on_gpu,
    dense_table,
    rel_err,
    run_tma,
)
from torch_kvq.attention.triton import decode_config as dc
from torch_kvq.spec_modes import FP8_DTYPE

LENS = (1, 15, 16, 17, 300, 1000)  # 1 .. 63 pages per pair


@pytest.mark.parametrize("nprog", [1, 2, 5, 64, 5000])
@pytest.mark.parametrize("qh,kh,d", [(8, 2, 64), (4, 2, 128)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (100, 5.0)], ids=["global", "swa_cap"])
def test_interpreter_matches_reference(interp, programs, nprog, qh, kh, d, window, soft_cap):
    programs(nprog)
    case = Case(LENS, qh, kh, d, seed=nprog)
    out = torch.full(case.q.shape, float("nan"), dtype=torch.float32)
    kw = dict(window=window, soft_cap=soft_cap, dot_dtype=torch.float32, programs_per_sm=1)
    run_tma(case, interp, out=out, **kw)
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-4, f"rel err {err:.2e}"  # NaN (a pair never written) fails too


@pytest.mark.parametrize("ppi,lazy", [(2, True), (4, False)])
def test_interpreter_pages_per_iteration_and_lazy_rescale(interp, programs, ppi, lazy) -> None:
    programs(7)
    case = Case(LENS, 8, 2, 64, seed=3)
    case.q = (case.q.float() * 20).to(torch.bfloat16)  # logits ~ +-60: the lazy max moves often
    out = torch.empty(case.q.shape, dtype=torch.float32)
    kw = dict(dot_dtype=torch.float32, pages_per_iter=ppi, lazy_rescale=lazy)
    run_tma(case, interp, out=out, programs_per_sm=1, **kw)
    assert rel_err(out, case.ref()) < 5e-4


def test_interpreter_workspace_and_bad_arguments(interp, programs) -> None:
    programs(3)
    case = Case(LENS, 8, 2, 64)
    ws = (torch.empty(3, 2, 4, 64), torch.empty(3, 2, 4))
    out = torch.empty(case.q.shape, dtype=torch.float32)
    run_tma(case, interp, out=out, programs_per_sm=1, workspace=ws, dot_dtype=torch.float32)
    assert rel_err(out, case.ref()) < 5e-4
    with pytest.raises(ValueError, match=r"balanced schedule needs \(3, 2, 4, 64\)"):
        run_tma(case, interp, programs_per_sm=1, workspace=(ws[0][:2], ws[1][:2]))
    with pytest.raises(ValueError, match="programs_per_sm=2 needs num_splits=None"):
        run_tma(case, interp, programs_per_sm=2, num_splits=4)
    with pytest.raises(ValueError, match="at least 1 program per SM"):
        run_tma(case, interp, programs_per_sm=0)


def test_default_schedule() -> None:
    """Pure host logic: the balanced schedule where the split grid would have 1-2 splits, for one
    code per element at head 128 (``BALANCED``'s one entry); the 4-bit loops keep the grid."""
    balanced = dc.BALANCED["codes"][128]
    assert dc.default_schedule(32, 8, 16384, 16, 128, sms=132) == (8, None)
    assert dc.default_schedule(64, 8, 16384, 16, 128, sms=132) == (4, None)
    assert dc.default_schedule(80, 8, 16384, 16, 128, sms=132) == (2, balanced)
    assert dc.default_schedule(110, 8, 16384, 16, 128, sms=132) == (2, balanced)
    assert dc.default_schedule(131, 8, 16384, 16, 256, sms=132) == (2, None)  # no head-256 entry
    assert dc.default_schedule(32, 8, 1000, 16, 128, sms=132) == (1, balanced)
    # per cache kind, the split grid aims at TUNED's programs per SM; the balanced schedule's
    # choice stays the 8-program rule's
    sched = functools.partial(dc.default_schedule, max_seq_len=16384, page=16, sms=132)
    assert sched(32, 8, head_size=128, kind="k8v4") == (4, None)
    assert sched(32, 8, head_size=256, kind="k8v4") == (4, None)
    assert sched(32, 8, head_size=128, kind="int4") == (8, None)
    assert sched(32, 8, head_size=256, kind="int4") == (4, None)
    assert sched(64, 8, head_size=128, kind="k8v4") == (2, None)
    assert sched(110, 8, head_size=128, kind="k8v4") == (1, None)
    assert sched(197, 8, head_size=128, kind="int4") == (1, None)  # int4-recommended's capacity
    assert sched(80, 8, head_size=128, kind="int4") == (4, None)  # TUNED's 10 programs per SM
    assert sched(80, 8, head_size=128, kind="k8v4") == (2, None)  # and 6
    assert sched(128, 8, head_size=128, kind="k8v4") == (1, None)
    assert sched(197, 8, head_size=128, kind="codes") == (1, balanced)
    assert sched(131, 8, head_size=256, kind="k8v4") == (1, None)


# -- GPU: the compiled kernel ---------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qh,kh,d,per_sm,regs", [(32, 8, 128, 16, 128), (16, 8, 256, 8, None)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (64, 5.0)], ids=["global", "swa_cap"])
@pytest.mark.parametrize("cache_dtype", [FP8_DTYPE, torch.bfloat16], ids=str)
def test_gpu_matches_reference(qh, kh, d, per_sm, regs, window, soft_cap, cache_dtype) -> None:
    kw = dict(programs_per_sm=per_sm, max_registers=regs)
    check_on_gpu((*LENS, 4097), qh, kh, d, cache_dtype, window, soft_cap, **kw)


@pytest.mark.gpu
@needs_gpu
def test_gpu_chosen_at_large_batch_and_matches_reference(monkeypatch) -> None:
    """72 sequences x 8 kv heads: the split grid would have 2 splits, so ``paged_decode_tma``
    takes the balanced schedule (``BALANCED``) by itself."""
    from torch_kvq.attention.triton import decode_balanced, decode_tma

    calls = []
    real = decode_balanced.decode_balanced
    monkeypatch.setattr(
        decode_balanced, "decode_balanced", lambda *a: calls.append(a[8]) or real(*a)
    )
    lens = tuple(
        int(x) for x in torch.randint(1, 700, (72,), generator=torch.Generator().manual_seed(2))
    )
    case = Case(lens, 32, 8, 128, seed=2, device="cuda")
    out = run_tma(case, decode_tma, **dc.tuned(128))
    assert calls == [dc.BALANCED["codes"][128][0]]
    assert rel_err(out, case.ref()) < 5e-3


@pytest.mark.gpu
@needs_gpu
def test_gpu_cuda_graph_replay_follows_new_lengths() -> None:
    """Captured once; on replay the units, runs and cut pairs follow the new seq_lens (computed
    on the device), including a total below the program count."""
    from torch_kvq.attention.triton import decode_balanced, decode_tma

    case = Case((1000, 1000, 1000), 32, 8, 128, seed=5, device="cuda")
    # TUNED's head-128 config at 128 registers: 16 programs per SM fit (at 2 pages per iteration,
    # 10: the launch takes no more than fit, and the workspace must match)
    n = decode_balanced.balanced_programs(case.q, 8, 1000, 16, 16)
    ws = tuple(torch.empty(s, device="cuda") for s in ((n, 2, 4, 128), (n, 2, 4)))
    out, table = torch.empty_like(case.q), dense_table(case)
    kw = dict(out=out, programs_per_sm=16, max_registers=128, workspace=ws)
    kw.update(dc.tuned(128))
    run = lambda: run_tma(case, decode_tma, table, **kw)  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in ((1, 500, 999), (1, 1, 2)):  # 3 x 8 pairs of 1 page < the programs
        case.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        case.lens = lens
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, case.ref()) < 5e-3, lens
