"""Where the graph runner's two copies first part ways: the GPU test
``test_graph_runner.py::test_captured_graphs_of_a_per_token_head_map_replay_the_uncaptured_steps``
(two gemma3-tiny copies, int8 per (token, head) on layer 0 and a 4-bit mode on the global layers
2 and 5, compiled with the kvq passes; prefill through the compiled graph, then the schedule's
decode steps through an uncapturing and a capturing ``DecodeGraphRunner``) failed on an H100 in
the forty-eighth session: alone in one process, its first mode (int4) passed and the next two
(k8v4, tc4) did not, the logits of sequence 2 apart at the first decode step
(docs/design/int4-branch.md). This builds the copies as the test does, the modes one after the
other in one process as pytest runs them, and prints, one JSON line per copy after the first
(against copy 0): after the prefill and after each decode step, which layers' cache bytes differ
and on which pages (with the sequence that owns each), and per step which logits rows differ.

``--copies`` spells the copies: ``F`` an uncapturing runner, ``T`` a capturing one (the test is
``FT``; ``FF`` tells whether capture matters at all), ``W`` as ``F`` but running a step twice
more before it the first time its padded size comes, as ``T``'s two warm-ups do (is a step
idempotent? Runs on the CPU too). ``--reset`` resets Dynamo before each mode
(does the process's compile history matter? The first mode compiles its prefill for static
shapes, the later ones for dynamic ones), ``--static`` compiles with ``dynamic=False``,
``--eager`` skips torch.compile, ``--attend`` adds ``hf_copies_diff.py``'s record of every
prefill attention call (q, output, tables, pages read) compared per call.

    python3 scripts/runner_copies_diff.py                    # the GPU test's three modes, FT
    python3 scripts/runner_copies_diff.py k8v4_per_token_head --reset --copies FF
    python3 scripts/runner_copies_diff.py int4_per_token_head --device cpu --copies FF --eager
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _owners(model: Any, pages: list[int]) -> list[list[object]]:
    """[page, owning sequence (the runner's pad sequence included) or None] per page id."""
    owner = {p: s for s in model.allocator.sequences for p in model.allocator.pages(s)}
    return [[p, owner.get(p)] for p in pages]


def cache_diff(first: Any, other: Any) -> dict[str, object]:
    """Per attention layer whose cache or scale bytes differ between two models: the page ids
    (dim 0 of both buffers) that differ and the sequence owning each."""
    out: dict[str, object] = {}
    for i, (a, b) in enumerate(zip(first.attention_layers, other.attention_layers)):
        pages = set()
        for x, y in ((a.kv_cache, b.kv_cache), (a.kv_scale, b.kv_scale)):
            if x is None or y is None:
                continue
            diff = (x.view(torch.uint8) != y.view(torch.uint8)).flatten(1).any(-1)
            pages |= set(diff.nonzero().flatten().tolist())
        if pages:
            out[f"layers.{i}"] = _owners(first, sorted(pages)[:8])
    return out


def _build(mode: str, device: str, letter: str, backend: Any, eager: bool, static: bool):
    """One copy as the test builds it: model, compiled forward, runner (scratch page first)."""
    from tests.attention.test_graph_runner import HEAD
    from tests.support.attention import k_basis
    from torch_kvq import KVCacheConfig
    from torch_kvq.attention.graph_runner import DecodeGraphRunner
    from torch_kvq.models import build_model

    bases = ((2, k_basis(2, 128, 2)), (5, k_basis(2, 128, 5))) if mode.startswith("tc4") else ()
    kv = KVCacheConfig("auto", layer_modes=(("full_attention", mode), (0, "int8_per_token_head")),
                       k_bases=bases, page_size=16)  # fmt: skip
    kernel = None
    if device == "cuda":
        from torch_kvq.attention.kernels import FlashInferKernel
        from torch_kvq.attention.kernels.flashinfer_jit import prebuild

        kernel = FlashInferKernel()
    m = build_model("gemma3-tiny", kv, num_pages=64, device=device, kernel=kernel, **HEAD)
    if kernel is not None:
        prebuild(kernel, m.kv_specs)
    fn = m if eager else torch.compile(m, backend=backend, **({"dynamic": False} if static else {}))
    runner = DecodeGraphRunner(m, fn, batch_sizes=(2, 4), max_context=64, capture=letter == "T")
    return m, fn, runner


def run_copies(modes: list[str], device: str, letters: str, reset: bool = False,
               static: bool = False, eager: bool = False, attend: bool = False,
               ) -> Iterator[dict[str, object]]:  # fmt: skip
    """Per mode, the copies ``letters`` spells, built and prefilled one after the other, then the
    test's schedule: one result per (point, copy after the first), each against copy 0."""
    from hf_copies_diff import AttendRecorder, compare_calls

    from tests.attention.test_graph_runner import PROMPTS, SCHEDULE, _prefill
    from torch_kvq.passes import make_kvq_backend

    if "T" in letters and device != "cuda":
        raise ValueError(f"copies {letters!r}: T (a capturing runner) needs --device cuda")
    recorder = AttendRecorder()
    for mode in modes:
        if reset:
            torch._dynamo.reset()
        backend = make_kvq_backend()
        models, runners = [], []
        patched = recorder.patched() if attend else contextlib.nullcontext()
        with torch._inductor.config.patch(deterministic=True), patched:
            recorder.copies.clear()
            for letter in letters:
                recorder.copies.append([])
                m, fn, runner = _build(mode, device, letter, backend, eager, static)
                _prefill(m, PROMPTS, torch.Generator().manual_seed(0), fn)
                models.append(m)
                runners.append(runner)
        for j in range(1, len(models)):
            res: dict[str, object] = {"mode": mode, "copies": [letters[0], letters[j]],
                                      "point": "prefill", "caches": cache_diff(models[0], models[j])}  # fmt: skip
            if attend:
                res["calls"] = compare_calls(recorder.copies[0], recorder.copies[j])
            yield res
        gen = torch.Generator().manual_seed(1)
        seen: list[set[int]] = [set() for _ in models]  # padded sizes each copy has run
        for step, seqs in enumerate(SCHEDULE):
            ids = torch.randint(0, models[0].config.vocab_size, (len(seqs),), generator=gen)
            outs = []
            for letter, r, m, sizes in zip(letters, runners, models, seen):
                md = m.allocator.build_batch([(s, 1) for s in seqs], device="cpu")
                size = min(b for b in r.batch_sizes if b >= len(seqs))
                if letter == "W" and size not in sizes:  # the warm-ups of a capture
                    for _ in range(2):
                        r(ids.to(device), md)
                sizes.add(size)
                outs.append(r(ids.to(device), md))
            for j in range(1, len(models)):
                rows = (outs[j] != outs[0]).any(-1).nonzero().flatten().tolist()
                yield {
                    "mode": mode, "copies": [letters[0], letters[j]], "point": f"step {step}",
                    "seqs": list(seqs), "rows_differ": [seqs[r] for r in rows],
                    "max_abs": float((outs[j].float() - outs[0].float()).abs().max()),
                    "caches": cache_diff(models[0], models[j]),
                }  # fmt: skip
        for r in runners:
            r.close()


def main() -> None:
    from tests.attention.test_graph_runner import GPU_MAP_MODES as MODES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modes", nargs="*", help=f"of {', '.join(MODES)} (default: all, in order)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--copies", default="FT", help="letters F, T, W: see the docstring")
    ap.add_argument("--reset", action="store_true", help="torch._dynamo.reset() before each mode")
    ap.add_argument("--static", action="store_true", help="torch.compile(dynamic=False)")
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--attend", action="store_true", help="record every prefill attention call")
    args = ap.parse_args()
    if len(args.copies) < 2 or set(args.copies) - set("FTW"):
        ap.error(f"--copies {args.copies!r}: expected two or more of the letters F, T, W")
    if set(args.modes) - set(MODES):
        ap.error(f"modes {args.modes}: expected some of {', '.join(MODES)}")
    for res in run_copies(args.modes or list(MODES), args.device, args.copies, args.reset,
                          args.static, args.eager, args.attend):  # fmt: skip
        print(json.dumps(res))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
