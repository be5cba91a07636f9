"""Where two copies of one HF model first part ways: the GPU test
``test_hf_gpu.py::test_gemma3_shaped_per_token_head_map_replays_in_cuda_graphs`` (two copies of a
Gemma-3-shaped model, int8 per (token, head) on sliding layer 0, a 4-bit mode on the global layer
5, compiled with the kvq passes) has seen its copies' prefill logits differ on H200s
(docs/design/int4-branch.md, thirteenth, twenty-sixth and thirty-ninth sessions). This builds the
copies as the test does (Dynamo reset once, static shapes, Inductor's deterministic mode; tc4 with
the test's K basis) and prints, per copy against copy 0 (one JSON line each), whether each
attention layer's cache is equal bit for bit, the prefill logits and the tokens.

``--copies`` spells the copies, one letter each: ``P`` prefill only (one new token, no runner),
``F`` six tokens through an uncapturing ``DecodeGraphRunner`` (batch 4), ``T`` through a
capturing one (the test is ``FT``), ``Z`` as ``F`` with every recorded call also re-run on a
zeroed FlashInfer workspace (does the kernel read workspace bytes it did not write? needs
``--attend``).
``--attend`` records every prefill attention call (the kernel's ``attend``): its q, output,
batch tables (qo / kv indptr, page ids, last page lengths), the pages and scales it reads, its
plan key, and a re-run on the spot; each call is compared with copy 0's, so the first layer whose
output differs, and whether its inputs did, is on one line. ``--load`` runs a second process of
matmuls and allocations on the GPU throughout; ``--eager`` skips torch.compile; ``--repeat N``
builds N sets of copies; ``--dirty`` fills freed GPU memory with 0x7F bytes before each copy;
``--nan-empty`` has torch fill every ``torch.empty`` with NaN; ``--history`` first runs what the
test file's first test does.

    python3 scripts/hf_copies_diff.py tc4_per_token_head --copies FTFZ --attend   # the GPU (FlashInfer)
    python3 scripts/hf_copies_diff.py k8v4_per_token_head --device cpu --eager --attend   # reference kernel
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import multiprocessing as mp
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("int4_per_token_head", "k8v4_per_token_head", "tc4_per_token_head")


def _load(stop: mp.Event) -> None:  # type: ignore[valid-type]
    """Other GPU work: matmuls and fresh allocations until ``stop``."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        junk = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0xFF)]
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        del junk
        torch.cuda.synchronize()


def _dirty() -> None:
    """Leave 0x7F garbage in the caching allocator's free blocks, small pool and large."""
    junk = [torch.full((256 << 10,), 0x7F, dtype=torch.uint8, device="cuda") for _ in range(2048)]
    junk.append(torch.full((4 << 30,), 0x7F, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    del junk


def history(device: str) -> None:
    """What test_hf_gpu.py's first test compiles before the failing one (an FP8 map on the
    same model class, generated eager then compiled) in the same process."""
    from tests.support.hf_families import gemma3_prompts, gemma3_shaped
    from torch_kvq import KVCacheConfig
    from torch_kvq.integrations.transformers import KVQCausalLM
    from torch_kvq.models import generate
    from torch_kvq.passes import make_kvq_backend

    kw = {}
    if device == "cuda":
        from torch_kvq.attention.kernels import FlashInferKernel

        kw["kernel"] = FlashInferKernel()
    kv = KVCacheConfig("fp8", skip_layers=("sliding_window",), page_size=16)
    lm = KVQCausalLM.from_hf(gemma3_shaped(device), kv, num_pages=160, **kw)
    prompts = gemma3_prompts()
    eager = generate(lm, prompts, 6)
    compiled = torch.compile(lm, backend=make_kvq_backend(), fullgraph=True)
    generate(lm, prompts, 6, compiled, force_tokens=eager.tokens)


class AttendRecorder:
    """Patches the kernels' ``attend`` (FlashInfer's and the reference's) to keep, per copy, one
    record per prefill call; ``zero_ws``: also re-run each call on a zeroed FlashInfer workspace."""

    def __init__(self) -> None:
        self.copies: list[list[dict[str, Any]]] = []
        self.zero_ws = False

    @contextlib.contextmanager
    def patched(self) -> Iterator[AttendRecorder]:
        from torch_kvq.attention.kernels import FlashInferKernel, ReferenceKernel

        saved = {cls: cls.attend for cls in (FlashInferKernel, ReferenceKernel)}
        for cls, orig in saved.items():
            cls.attend = self._wrap(orig)  # type: ignore[method-assign]
        try:
            yield self
        finally:
            for cls, orig in saved.items():
                cls.attend = orig  # type: ignore[method-assign]

    def _wrap(self, orig: Any) -> Any:
        def attend(kernel: Any, ctx: Any, spec: Any, q: torch.Tensor, kv_cache: torch.Tensor,
                   *a: Any, **kw: Any) -> torch.Tensor:  # fmt: skip
            out = orig(kernel, ctx, spec, q, kv_cache, *a, **kw)
            if self.copies and not ctx.metadata.is_decode_only:
                self._record(orig, kernel, ctx, spec, q, kv_cache, out, a, kw)
            return out

        return attend

    def _record(self, orig: Any, kernel: Any, ctx: Any, spec: Any, q: torch.Tensor,
                kv_cache: torch.Tensor, out: torch.Tensor, a: Any, kw: Any) -> None:  # fmt: skip
        again = orig(kernel, ctx, spec, q, kv_cache, *a, **kw)
        zero_equal = None
        ws = getattr(kernel, "_float_ws", None)
        if self.zero_ws and ws is not None:
            kept = ws.clone()
            ws.zero_()
            zero_equal = torch.equal(out, orig(kernel, ctx, spec, q, kv_cache, *a, **kw))
            ws.copy_(kept)
        md = ctx.metadata_for(spec)
        ids = md.kv_indices.long()
        kv_scale = kw.get("kv_scale", a[3] if len(a) > 3 else None)
        plan = getattr(ctx, "plans", {}).get((id(kernel), spec.name, kv_cache.dtype))
        self.copies[-1].append({
            "layer": _unprefixed(spec.name),
            "key": None if plan is None else plan.key,
            "q": q.clone(), "out": out.clone(), "rerun_equal": torch.equal(out, again),
            "zero_ws_equal": zero_equal,
            "tables": [t.clone() for t in (md.qo_indptr, md.kv_indptr, md.kv_indices,
                                           md.kv_last_page_len)],
            "pages": kv_cache[ids].view(torch.uint8),  # indexing by a tensor copies already
            "scales": None if kv_scale is None else kv_scale[ids],
        })  # fmt: skip


def _unprefixed(name: str) -> str:
    """A layer's name without its copy's prefix (``copy1.layers.3.self_attn`` -> ``layers.3``)."""
    return ".".join(name.split(".")[1:3])


def _bytes_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def compare_calls(first: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[dict]:
    """Each recorded prefill call of a copy against copy 0's, in call order."""
    rows = []
    for x, y in zip(first, other):
        row = {
            "layer": y["layer"],
            "kernel": None if y["key"] is None else f"{y['key'].kernel}/{y['key'].backend}",
            "window": None if y["key"] is None else y["key"].window,
            "key_equal": x["key"] == y["key"],
            "q_equal": torch.equal(x["q"], y["q"]),
            "out_equal": torch.equal(x["out"], y["out"]),
            "rerun_equal": [x["rerun_equal"], y["rerun_equal"]],
            "zero_ws_equal": y["zero_ws_equal"],
            "tables_equal": all(torch.equal(s, t) for s, t in zip(x["tables"], y["tables"])),
            "pages_equal": _bytes_equal(x["pages"], y["pages"]),
            "scales_equal": _bytes_equal(x["scales"], y["scales"]),
        }
        if not row["out_equal"] and x["out"].shape == y["out"].shape:
            diff = (x["out"] != y["out"]).flatten(1).any(-1).nonzero().flatten()
            row["out_rows_differ"] = [int(diff.numel()), diff[:6].tolist()]
        if not row["pages_equal"] and x["pages"].shape == y["pages"].shape:
            # (page of the table, k or v, slot): slots past a sequence's end are never written
            at = (x["pages"] != y["pages"]).flatten(3).any(-1).nonzero()
            row["pages_differ_at"] = at[:4].tolist()
            row["last_page_len"] = x["tables"][3].tolist()
        rows.append(row)
    if len(first) != len(other):
        rows.append({"calls": [len(first), len(other)]})
    return rows


def run_copies(mode: str, device: str, letters: str, eager: bool = False, dirty: bool = False,
               attend: bool = False) -> list[dict[str, object]]:  # fmt: skip
    """The copies ``letters`` spells, one after the other as the test builds them; one result
    per copy after the first, each against copy 0."""
    from tests.support.attention import k_basis
    from tests.support.hf_families import gemma3_prompts, gemma3_shaped
    from tests.support.passes import DETERMINISTIC
    from torch_kvq import KVCacheConfig
    from torch_kvq.attention.graph_runner import DecodeGraphRunner
    from torch_kvq.integrations.transformers import KVQCausalLM
    from torch_kvq.models import generate
    from torch_kvq.passes import make_kvq_backend

    if "T" in letters and device != "cuda":
        raise ValueError(f"copies {letters!r}: T (a capturing runner) needs --device cuda")
    kv = KVCacheConfig(
        "auto", layer_modes=(("full_attention", mode), (0, "int8_per_token_head")), page_size=16,
        k_bases={5: k_basis(2, 256, 5)} if mode.startswith("tc4") else {},
    )  # fmt: skip
    hf = gemma3_shaped(device)
    prompts = gemma3_prompts()
    backend = make_kvq_backend(config_patches=DETERMINISTIC)
    recorder = AttendRecorder()
    lms, runs = [], []
    torch._dynamo.reset()
    with recorder.patched():
        for i, letter in enumerate(letters):
            if dirty:
                _dirty()
            if attend:
                recorder.copies.append([])
            recorder.zero_ws = letter == "Z"
            kw = {}
            if device == "cuda":
                from torch_kvq.attention.kernels import FlashInferKernel
                from torch_kvq.attention.kernels.flashinfer_jit import prebuild

                kw["kernel"] = FlashInferKernel()
            lm = KVQCausalLM.from_hf(copy.deepcopy(hf), kv, num_pages=160, prefix=f"copy{i}", **kw)
            if "kernel" in kw:
                prebuild(kw["kernel"], lm.kv_specs)
            fwd = lm if eager else torch.compile(lm, backend=backend, fullgraph=True, dynamic=False)
            if letter == "P":  # one new token: the prefill only (the cache bytes remain)
                runs.append(generate(lm, prompts, 1, fwd, prefill_logits=True))
            else:
                with DecodeGraphRunner(lm, fwd, batch_sizes=(4,), max_context=1200,
                                       capture=letter == "T") as r:  # fmt: skip
                    runs.append(generate(lm, prompts, 6, fwd, decode=r, prefill_logits=True))
            lms.append(lm)
    results = []
    for j in range(1, len(lms)):
        layers = {}
        for a, b in zip(lms[0].attention_layers, lms[j].attention_layers):
            same = _bytes_equal(a.kv_cache, b.kv_cache) and _bytes_equal(a.kv_scale, b.kv_scale)
            layers[_unprefixed(a.spec.name)] = {"mode": a.spec.mode.value, "cache_equal": same}
        pre = [torch.equal(x, y) for x, y in zip(runs[0].prefill_logits, runs[j].prefill_logits)]
        first = [
            None if same else int((x != y).any(-1).nonzero()[0])
            for same, x, y in zip(pre, runs[0].prefill_logits, runs[j].prefill_logits)
        ]
        res: dict[str, object] = {"copies": [letters[0], letters[j]], "layers": layers,
                                  "prefill_logits_equal": pre, "first_differing_position": first}  # fmt: skip
        if letters[0] != "P" and letters[j] != "P":
            res["tokens_equal"] = runs[0].tokens == runs[j].tokens
            res["logits_equal"] = torch.equal(runs[0].logits, runs[j].logits)
        if attend:
            res["calls"] = compare_calls(recorder.copies[0], recorder.copies[j])
        results.append(res)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--copies", default="PP", help="letters P, F, T, Z: see the docstring")
    ap.add_argument("--attend", action="store_true", help="record every prefill attention call")
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--load", action="store_true", help="a second process on the GPU throughout")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--dirty", action="store_true", help="0x7F garbage in freed GPU memory")
    ap.add_argument("--history", action="store_true", help="first what the file's first test runs")
    ap.add_argument("--nan-empty", action="store_true", help="torch.empty filled with NaN")
    args = ap.parse_args()
    if len(args.copies) < 2 or set(args.copies) - set("PFTZ"):
        ap.error(f"--copies {args.copies!r}: expected two or more of the letters P, F, T, Z")
    if "Z" in args.copies and not args.attend:
        ap.error(f"--copies {args.copies!r}: Z re-runs the recorded calls, so it needs --attend")
    if args.nan_empty:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    stop, proc = None, None
    if args.load:
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        proc = ctx.Process(target=_load, args=(stop,), daemon=True)
        proc.start()
    try:
        if args.history:
            history(args.device)
        for i in range(args.repeat):
            for res in run_copies(args.mode, args.device, args.copies, args.eager, args.dirty,
                                  args.attend):  # fmt: skip
                print(json.dumps({"set": i, **res}))
                sys.stdout.flush()
    finally:
        if proc is not None and stop is not None:
            stop.set()
            proc.join(timeout=30)


if __name__ == "__main__":
    main()
