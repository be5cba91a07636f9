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
prefill attention call (q, output, tables, pages read) compared per call. ``--trace`` keeps every
submodule's prefill output (forward hooks; under torch.compile Dynamo traces them into the graph)
and prints the first that differ from copy 0's, with their rows. ``--poison`` fills the CUDA
caching allocator's free blocks with 0xFF bytes (NaN in every float dtype) before each copy is
built: a kernel that reads memory it never wrote then gives NaN (or differs between copies).
Every compile is in Inductor's deterministic mode, given to the backend (``DETERMINISTIC``, as
the test does); ``--global-patch`` sets it process-wide instead, as the test did before the
fiftieth session: it then holds for the first compile only (Dynamo resets it after its first
trace), and the copies part.

    python3 scripts/runner_copies_diff.py                    # the GPU test's three modes, FT
    python3 scripts/runner_copies_diff.py k8v4_per_token_head --reset --copies FF
    python3 scripts/runner_copies_diff.py int4_per_token_head --device cpu --copies FF --eager
    python3 scripts/runner_copies_diff.py int4_per_token_head --copies FF --eager --trace --poison
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


class Tracer:
    """Forward hooks on every submodule of each copy: (module name, output clone) per call while
    ``on``, one list per copy."""

    def __init__(self) -> None:
        self.copies: list[list[tuple[str, torch.Tensor]]] = []
        self.on = False

    def hook(self, model: torch.nn.Module) -> None:
        self.copies.append([])
        calls = self.copies[-1]
        for name, mod in model.named_modules():
            if name:
                mod.register_forward_hook(self._keep(name, calls))

    def _keep(self, name: str, calls: list[tuple[str, torch.Tensor]]) -> Any:
        def keep(mod: Any, args: Any, out: Any) -> None:
            x = out[0] if isinstance(out, tuple) else out
            if self.on and isinstance(x, torch.Tensor):
                calls.append((name, x.detach().clone()))

        return keep

    def first_differences(self, j: int, limit: int = 8) -> list[dict[str, object]]:
        """Copy ``j``'s first ``limit`` outputs that differ from copy 0's (bits, NaN counted)."""
        rows: list[dict[str, object]] = []
        for (name, x), (_, y) in zip(self.copies[0], self.copies[j]):
            if len(rows) >= limit:
                break
            if x.shape == y.shape and torch.equal(_bits(x), _bits(y)):
                continue
            row: dict[str, object] = {"module": name, "shape": list(y.shape),
                                      "nan": [int(x.isnan().sum()), int(y.isnan().sum())]}  # fmt: skip
            if x.shape == y.shape and x.dim() > 0:
                d = (x != y).flatten(1).any(-1) if x.dim() > 1 else x != y
                row["rows"] = d.nonzero().flatten()[:12].tolist()
                row["max_abs"] = float((x.float() - y.float()).abs().nan_to_num(-1).max())
            rows.append(row)
        if len(self.copies[0]) != len(self.copies[j]):
            rows.append({"calls": [len(self.copies[0]), len(self.copies[j])]})
        return rows


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1).view(torch.uint8)


def poison(device: str) -> None:
    """Fill the caching allocator's free blocks (small and large pools) with 0xFF bytes."""
    if device != "cuda":
        return
    held = [torch.full((n,), 255, dtype=torch.uint8, device=device)
            for n, k in ((1 << 18, 400), (8 << 20, 24), (64 << 20, 4)) for _ in range(k)]  # fmt: skip
    torch.cuda.synchronize()
    del held


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
               trace: bool = False, poisoned: bool = False, global_patch: bool = False,
               ) -> Iterator[dict[str, object]]:  # fmt: skip
    """Per mode, the copies ``letters`` spells, built and prefilled one after the other, then the
    test's schedule: one result per (point, copy after the first), each against copy 0."""
    from hf_copies_diff import AttendRecorder, compare_calls

    from tests.attention.test_graph_runner import PROMPTS, SCHEDULE, _prefill
    from tests.support.passes import DETERMINISTIC
    from torch_kvq.passes import make_kvq_backend

    if "T" in letters and device != "cuda":
        raise ValueError(f"copies {letters!r}: T (a capturing runner) needs --device cuda")
    recorder = AttendRecorder()
    tracer = Tracer()
    for mode in modes:
        if reset:
            torch._dynamo.reset()
        backend = make_kvq_backend(config_patches={} if global_patch else DETERMINISTIC)
        models, runners = [], []
        patched = recorder.patched() if attend else contextlib.nullcontext()
        glob = (torch._inductor.config.patch(deterministic=True) if global_patch
                else contextlib.nullcontext())  # fmt: skip
        with glob, patched:
            recorder.copies.clear()
            tracer.copies.clear()
            for letter in letters:
                recorder.copies.append([])
                if poisoned:
                    poison(device)
                m, fn, runner = _build(mode, device, letter, backend, eager, static)
                if trace:
                    tracer.hook(m)
                tracer.on = trace
                _prefill(m, PROMPTS, torch.Generator().manual_seed(0), fn)
                tracer.on = False
                models.append(m)
                runners.append(runner)
        for j in range(1, len(models)):
            res: dict[str, object] = {"mode": mode, "copies": [letters[0], letters[j]],
                                      "point": "prefill", "caches": cache_diff(models[0], models[j])}  # fmt: skip
            if attend:
                res["calls"] = compare_calls(recorder.copies[0], recorder.copies[j])
            if trace:
                res["trace"] = tracer.first_differences(j)
                res["traced"] = [len(tracer.copies[0]), len(tracer.copies[j])]
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
    ap.add_argument("--trace", action="store_true", help="every submodule's prefill output")
    ap.add_argument("--poison", action="store_true", help="0xFF the allocator's free blocks first")
    ap.add_argument("--global-patch", action="store_true",
                    help="Inductor's deterministic mode as a process-wide patch, not the backend's")  # fmt: skip
    args = ap.parse_args()
    if len(args.copies) < 2 or set(args.copies) - set("FTW"):
        ap.error(f"--copies {args.copies!r}: expected two or more of the letters F, T, W")
    if set(args.modes) - set(MODES):
        ap.error(f"modes {args.modes}: expected some of {', '.join(MODES)}")
    for res in run_copies(args.modes or list(MODES), args.device, args.copies, args.reset,
                          args.static, args.eager, args.attend, args.trace, args.poison,
                          args.global_patch):  # fmt: skip
        print(json.dumps(res))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
