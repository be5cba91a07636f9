"""The TMA-per-page Triton decode kernel (``attention/triton/decode_tma.py``) against the
reference attention on the same FP8 cache.

CPU: Triton's interpreter (``triton_case``, fp32 products); GPU: the compiled kernel with its
default fp16 products, under the gate. Without Triton every test here skips.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_case import (
    HAS_CUDA,
    LENS,
    Case,
    ScaledCase,
    check_on_gpu,
    dense_table,
    rel_err,
    run_tma,
)
from torch_kvq.attention.triton import decode_config as dc
from torch_kvq.spec_modes import FP8_DTYPE


@pytest.mark.parametrize("qh,kh,d", [(4, 4, 64), (8, 2, 128), (4, 2, 256)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (100, 5.0)], ids=["global", "swa_cap"])
@pytest.mark.parametrize("ppi", [1, 2, 4])
def test_interpreter_matches_reference(
    interp, qh, kh, d, num_splits, window, soft_cap, ppi
) -> None:
    case = Case(LENS, qh, kh, d)
    out = torch.empty(case.q.shape, dtype=torch.float32)
    kw = dict(window=window, soft_cap=soft_cap, dot_dtype=torch.float32, pages_per_iter=ppi)
    run_tma(case, interp, out=out, num_splits=num_splits, **kw)
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-4, f"rel err {err:.2e}"


@pytest.mark.parametrize("qh,kh,d", [(8, 2, 128), (4, 2, 64)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (100, 5.0)], ids=["global", "swa_cap"])
@pytest.mark.parametrize("q_gain", [1.0, 20.0], ids=["q1", "q20"])
@pytest.mark.parametrize("ppi,num_splits", [(1, 1), (2, 3)])
def test_interpreter_lazy_rescale_matches_reference(
    interp, qh, kh, d, window, soft_cap, q_gain, ppi, num_splits
) -> None:
    """The reference max moves only past 2^8 growth; q x 20 makes it move often (logits ~ +-60)."""
    case = Case(LENS, qh, kh, d, seed=7)
    case.q = (case.q.float() * q_gain).to(torch.bfloat16)
    out = torch.empty(case.q.shape, dtype=torch.float32)
    kw = dict(window=window, soft_cap=soft_cap, dot_dtype=torch.float32, pages_per_iter=ppi)
    run_tma(case, interp, out=out, num_splits=num_splits, lazy_rescale=True, **kw)
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-4, f"rel err {err:.2e}"


def test_interpreter_rejects_bad_inputs(interp) -> None:
    case = Case((5,), 8, 4, 64)
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        case.kv_cache = case.kv_cache.transpose(2, 3).contiguous().transpose(2, 3)
        run_tma(case, interp)
    case = Case((5,), 8, 4, 64, page=8)
    with pytest.raises(ValueError, match="page >= 16"):
        run_tma(case, interp)
    case = Case((5,), 8, 4, 64)
    with pytest.raises(ValueError, match="dot_dtype"):
        run_tma(case, interp, dot_dtype=torch.int8)
    with pytest.raises(ValueError, match="pages_per_iter must be 1, 2 or 4, got 3"):
        run_tma(case, interp, pages_per_iter=3)


def test_default_splits_and_tuned_configs() -> None:
    """Pure host logic (runs wherever Triton imports, interpreter or not)."""
    assert dc.default_num_splits(32, 8, 16384, 16, sms=132) == 8  # 8 * 132 / 256 -> 8
    assert dc.default_num_splits(110, 8, 16384, 16, sms=132) == 2
    assert dc.default_num_splits(32, 8, 1000, 16, sms=132) == 1  # < 64 pages: one split
    assert dc.default_num_splits(1, 1, 2**20, 16, sms=132) == 64  # capped
    assert dc.default_num_splits(32, 8, 16384, 16, sms=132, programs_per_sm=4) == 4
    assert dc.tuned(128) == dict(
        num_warps=1, num_stages=6, pages_per_iter=1, lazy_rescale=True, max_registers=None
    )
    assert dc.tuned(256)["pages_per_iter"] == 1 and dc.tuned(64) == dc.tuned(128)
    assert dc.tuned(128, "k8v4")["num_stages"] == 6
    # the split grid's aim: fewer, longer programs for k8v4 and int4 at head 256, more for int4
    # at head 128
    grids = [dc.tuned_grid(h, k) for k in ("codes", "int4", "k8v4") for h in (128, 256)]
    assert grids == [8, 8, 10, 4, 6, 4]
    assert dc.tuned_grid(64, "int4") == dc.tuned_grid(128, "int4")
    with pytest.raises(ValueError, match="cache kind 'int3'"):
        dc.tuned_grid(128, "int3")
    assert dc.tuned(64, "int4") == dc.tuned(128, "int4")
    # int4 at head 256: two pages per iteration without a cap (measured faster than one page
    # under a cap of 192)
    assert dc.tuned(256, "int4")["pages_per_iter"] == 2
    assert dc.tuned(256, "int4")["max_registers"] is None
    assert dc.tuned(256, "k8v4")["max_registers"] is None
    with pytest.raises(ValueError, match="cache kind 'int3'"):
        dc.tuned(128, "int3")
    kinds = [dc.cache_kind(torch.empty(1, slots, 16, 1, 64, dtype=dt))
             for dt, slots in ((torch.uint8, 2), (torch.uint8, 3), (torch.int8, 2), (FP8_DTYPE, 2))]  # fmt: skip
    assert kinds == ["int4", "k8v4", "codes", "codes"]
    modes = ("int4_per_token_head", "k8v4_per_token_head", "int8_per_token_head", "fp8_e4m3")
    assert [dc.mode_cache_kind(m) for m in modes] == kinds


def test_tuned_configs_follow_the_page_size() -> None:
    """BY_PAGE's measured entries replace TUNED's at their page size; another page size takes
    TUNED's with its pages per iteration cut to one iteration's tokens at 16-token pages."""
    assert dc.tuned(256, "int4", page=16)["pages_per_iter"] == 2  # 32 tokens an iteration
    assert dc.tuned(256, "int4", page=32)["pages_per_iter"] == 1  # two 32-token pages: half speed
    assert dc.tuned(256, "int4", page=64)["pages_per_iter"] == 1  # not measured: the cut
    assert dc.tuned(128, "k8v4", page=64)["num_stages"] == 4
    assert dc.tuned(128, "k8v4", page=32)["num_stages"] == 6  # measured: 16's is fastest
    assert dc.tuned(256, "k8v4", page=32)["num_stages"] == 4
    assert dc.tuned(128, "int4", page=32) == dc.tuned(128, "int4")
    for (kind, head, page), entry in dc.BY_PAGE.items():
        assert dc.tuned_grid(head, kind, page) == entry[5]
        assert dc.resolve_config(head, kind, page=page) == dc.tuned(head, kind, page=page)
        assert page != 16 and kind in dc.TUNED  # 16-token pages are TUNED's own
    with pytest.raises(ValueError, match="cache kind 'int3'"):
        dc.tuned(128, "int3", page=32)
    # the split grid aims at the page's entry: k8v4 at head 256 with 32-token pages
    assert dc.default_schedule(32, 8, 16384, 32, 256, sms=132, kind="k8v4") == (
        dc.default_num_splits(32, 8, 16384, 32, 132, dc.BY_PAGE["k8v4", 256, 32][5]),
        None,
    )


def test_interpreter_defaults_follow_the_page_size(interp, monkeypatch) -> None:
    """paged_decode_tma asks for its cache's page size's config: at 32-token pages with
    pages_per_iter 2 in TUNED, the default runs one page per iteration, and equals it spelled
    out (interpreter, fp32)."""
    monkeypatch.setitem(dc.TUNED["codes"], 128, (1, 3, 2, False, None, 8))
    asked = []
    resolve = dc.resolve_config
    monkeypatch.setattr(
        "torch_kvq.attention.triton.decode_tma.resolve_config",
        lambda *a, **kw: asked.append(a) or resolve(*a, **kw),
    )
    case = Case(LENS, 8, 2, 128, page=32)
    outs = [torch.empty(case.q.shape, dtype=torch.float32) for _ in range(2)]
    run_tma(case, interp, out=outs[0], dot_dtype=torch.float32, num_splits=3)
    assert asked[0][3] == 32 and dc.tuned(128, page=32)["pages_per_iter"] == 1
    run_tma(
        case, interp, out=outs[1], dot_dtype=torch.float32, num_splits=3, **dc.tuned(128, page=32)
    )
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert rel_err(outs[0], case.ref(None, None)) < 5e-4


def test_unset_config_takes_tuned_and_only_tuned_gets_the_register_cap(monkeypatch) -> None:
    """paged_decode_tma's config arguments left None are tuned(D)'s; BALANCED's register cap
    applies only to that config (pages_per_iter=2 spilled under it: 2.5x slower, run 54)."""
    assert dc.resolve_config(128) == dc.tuned(128)
    assert dc.resolve_config(256, num_warps=None) == dc.tuned(256)
    got = dc.resolve_config(128, pages_per_iter=2, lazy_rescale=False)
    assert got == {**dc.tuned(128), "pages_per_iter": 2, "lazy_rescale": False}
    cap = dc.BALANCED["codes"][128][1]
    assert dc.balanced_registers(128, dc.resolve_config(128), cap) == cap
    assert dc.balanced_registers(128, got, cap) is None
    # per page loop: int4's tuned config at head 256 is not the 8-bit caches', and the cap
    # follows it
    int4 = dc.resolve_config(256, "int4")
    assert int4 == dc.tuned(256, "int4") != dc.tuned(256)
    assert dc.balanced_registers(256, int4, cap, "int4") == cap
    assert dc.balanced_registers(256, int4, cap) is None
    # a TUNED config's own cap (none has one now; the twelfth session's int4 entry at head 256
    # had) comes with that config only, unless given
    monkeypatch.setitem(dc.TUNED["int4"], 256, (1, 6, 1, False, 192, 4))
    assert dc.resolve_config(256, "int4")["max_registers"] == 192
    assert dc.resolve_config(256, "int4", num_stages=6)["max_registers"] == 192
    assert dc.resolve_config(256, "int4", num_stages=8)["max_registers"] is None
    assert dc.resolve_config(256, "int4", num_stages=8, max_registers=0)["max_registers"] == 0
    int4 = dc.resolve_config(256, "int4")
    assert dc.balanced_registers(256, int4, 168, "int4") == 168
    assert dc.balanced_registers(256, int4, 168, "k8v4") is None


def test_interpreter_defaults_run_the_tuned_config(interp) -> None:
    """No config arguments: the same output as tuned(D)'s spelled out (interpreter, fp32)."""
    case = Case(LENS, 8, 2, 128)
    outs = [torch.empty(case.q.shape, dtype=torch.float32) for _ in range(2)]
    run_tma(case, interp, out=outs[0], dot_dtype=torch.float32, num_splits=3)
    run_tma(case, interp, out=outs[1], dot_dtype=torch.float32, num_splits=3, **dc.tuned(128))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert rel_err(outs[0], case.ref(None, None)) < 5e-4


# -- GPU: the compiled kernel ---------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qh,kh,d", [(32, 8, 128), (16, 8, 256), (8, 8, 64), (64, 8, 128)])
@pytest.mark.parametrize("num_splits", [1, None])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (64, 5.0)], ids=["global", "swa_cap"])
@pytest.mark.parametrize(
    "cache_dtype,ppi", [(FP8_DTYPE, 1), (FP8_DTYPE, 2), (torch.bfloat16, 2)], ids=str
)
def test_gpu_matches_reference(qh, kh, d, num_splits, window, soft_cap, cache_dtype, ppi) -> None:
    kw = dict(num_splits=num_splits, pages_per_iter=ppi)
    check_on_gpu((*LENS, 4097), qh, kh, d, cache_dtype, window, soft_cap, **kw)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    "num_warps,num_stages,ppi", [(2, 4, 1), (4, 8, 1), (4, 16, 1), (1, 6, 2), (2, 3, 4), (4, 2, 4)]
)
def test_gpu_pipelines_match_reference(num_warps, num_stages, ppi) -> None:
    from torch_kvq.attention.triton import decode_tma

    case = Case(LENS, 32, 8, 128, seed=4, device="cuda")
    out = torch.empty(case.q.shape, dtype=torch.float32, device="cuda")
    kw = dict(num_warps=num_warps, num_stages=num_stages, pages_per_iter=ppi)
    run_tma(case, decode_tma, out=out, num_splits=3, **kw)
    assert rel_err(out, case.ref()) < 2e-3


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qh,kh,d", [(32, 8, 128), (16, 8, 256), (8, 8, 64)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (64, 5.0)], ids=["global", "swa_cap"])
@pytest.mark.parametrize("q_gain", [1.0, 20.0], ids=["q1", "q20"])
@pytest.mark.parametrize("ppi", [1, 2])
def test_gpu_lazy_rescale_matches_reference(qh, kh, d, ppi, window, soft_cap, q_gain) -> None:
    """Lazy rescale, compiled (fp16 products: p <= 2^8 must stay exact), against the reference
    and against the eager rescale."""
    from torch_kvq.attention.triton import decode_tma

    case = Case((*LENS, 4097), qh, kh, d, seed=8, device="cuda")
    case.q = (case.q.float() * q_gain).to(torch.bfloat16)
    kw = dict(window=window, soft_cap=soft_cap, pages_per_iter=ppi)
    out = run_tma(case, decode_tma, lazy_rescale=True, **kw)
    assert torch.isfinite(out).all()
    err = rel_err(out, case.ref(window, soft_cap))
    assert err < 5e-3, f"rel err {err:.2e}"
    eager = run_tma(case, decode_tma, lazy_rescale=False, **kw)
    assert rel_err(out, eager) < 2e-3


@pytest.mark.gpu
@needs_gpu
def test_gpu_cuda_graph_replay_follows_new_lengths() -> None:
    """Captured once; replays read seq_lens / page tables from the device (no baked lengths)."""
    from torch_kvq.attention.triton import decode_tma

    case = Case((1000, 1000, 1000), 32, 8, 128, seed=5, device="cuda")
    ws = tuple(torch.empty(s, device="cuda") for s in ((3, 32, 4, 128), (3, 32, 4)))
    out, table = torch.empty_like(case.q), dense_table(case)  # the table: before the capture
    run = lambda: run_tma(case, decode_tma, table, out=out, num_splits=4, workspace=ws)  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    case.seq_lens.copy_(torch.tensor([1, 500, 999], dtype=torch.int32))
    case.lens = (1, 500, 999)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, case.ref()) < 5e-3


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("mode", ["int8", "int4", "k8v4"])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("schedule", ["split_grid", "balanced"])
def test_gpu_repeated_calls_are_bitwise_equal(mode: str, d: int, schedule: str) -> None:
    """Every program's pipeline (TMA boxes in flight, their barriers, the scales' copies) at the
    TUNED configs, short runs of pages included: 100 calls on one input give one output bit for
    bit. A shared-memory race shows up here as calls that differ, which an accuracy test within
    its tolerance can miss (and the CUDA-graph model tests compare bit for bit)."""
    from torch_kvq.attention.triton import decode_tma

    case = ScaledCase((1, 15, 40, 300, 1100, 4097), 16 if d == 128 else 8, 4, d, mode,
                      device="cuda", seed=d)  # fmt: skip
    kw = dict(programs_per_sm=8) if schedule == "balanced" else {}
    first = run_tma(case, decode_tma, **kw)
    outs = [run_tma(case, decode_tma, **kw) for _ in range(100)]
    torch.cuda.synchronize()
    differ = [i for i, o in enumerate(outs) if not torch.equal(o, first)]
    assert not differ, f"{len(differ)} of 100 calls differ from the first (calls {differ[:5]})"
    assert rel_err(first, case.ref()) < 5e-3
