"""``kvq demo``: a mixed FP8 / bf16 KV-cache model generating, checked against its own run with
a model-dtype cache.

By default the trained Gemma-3-270M (``--model gemma3-270m``): its sliding-window layers keep the
model-dtype cache, its global layers FP8; a few English prompts continued greedily with both
caches, side by side, the per-layer plan (what the passes fuse, per layer) and how far the logits
are apart. ``--preset`` / ``--hf`` run a tiny random-weight model instead (for tests: fast, but
its tokens mean nothing).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from typing import Any

from torch_kvq.cli.args import (
    SUBCOMMANDS,
    CommandError,
    add_model_args,
    add_wide_arg,
    model_label,
    positive_int,
)

COMPILE_MODES = ("off", "kvq", "kvq-eager")
# kvq-eager: kvq_backend's passes on the real post-grad graph, then the FX graph runs without
# Inductor codegen. "kvq" adds Inductor. A trained model runs eager by default: tracing a
# transformers model takes far longer on a CPU than the demo's generation.
DEFAULT_COMPILE = {"preset": "kvq-eager", "trained": "off"}
PROMPT_LENS = (5, 23, 12)  # random prompts of the tiny models
PROMPTS = (  # a trained model's prompts
    "The history of the city begins",
    "She opened the letter and read",
    "The most important thing about a good experiment is",
)
DEFAULT_NEW_TOKENS = {"preset": 8, "trained": 16}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help=SUBCOMMANDS["demo"][1],
        description="Generate with a small mixed FP8/bf16 KV-cache model (fixed random weights) "
        "and compare its logits with an all-bf16 run fed the same tokens.",
    )
    # --model|--preset|--hf|--hf-config --kv-cache-dtype --skip/--no-skip ... --seed
    add_model_args(p, default_model="gemma3-270m")
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help="default: 16 for a trained model, 8 for a tiny one",
    )
    p.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default=None,
        help="off: eager (the unfused reference form; a trained model's default); kvq: "
        "torch.compile(backend=kvq_backend), the passes then Inductor; kvq-eager: the passes "
        "without Inductor codegen (the tiny models' default)",
    )
    p.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="tensor parallelism over N CPU processes (gloo): re-runs this command under "
        "torchrun --standalone --nproc-per-node N; each rank holds 1/N of the KV heads",
    )
    add_wide_arg(p)
    p.set_defaults(func=run)


def _kvq_backend(mode: str) -> Any:
    """The compile backend for ``--compile kvq`` / ``kvq-eager``, imported only then."""
    try:
        from torch_kvq.passes import kvq_backend, make_kvq_backend
    except ImportError as e:
        raise CommandError(
            f"--compile {mode} needs torch_kvq.passes.kvq_backend, which failed to import ({e}); "
            "use --compile off"
        ) from e
    return kvq_backend if mode == "kvq" else make_kvq_backend(inner="eager")


def _bar(
    label: str, total: int, times: list[float] | None = None, compiled: bool = False
) -> tuple[Any, Any]:
    """A progress bar on stderr (terminal only) and the ``on_step`` callback that moves it: the
    step running is the prefill, then decode steps (a compile shows inside the step needing it)."""
    from torch_kvq.progress import Progress

    bar = Progress(label, total)
    bar.update(status="prefill (the first call traces and compiles)" if compiled else "prefill")

    def on_step(done: int, total: int, seconds: float) -> None:
        if times is not None:
            times.append(seconds)
        bar.update(done, status=f"decode step {done}" if done < total else "done")

    return bar, on_step


def _check_tp(args: argparse.Namespace) -> None:
    """``--tp N``, checked before torchrun starts: the model's heads split N ways, and this torch
    has torch.distributed and torchrun."""
    import importlib.util

    import torch.distributed as dist

    from torch_kvq.cli.sources import check_tp

    check_tp(args, args.tp)
    if not dist.is_available() or importlib.util.find_spec("torch.distributed.run") is None:
        raise CommandError(
            f"--tp {args.tp} re-runs this command under torchrun (torch.distributed.run), which "
            "this torch build lacks; run without --tp"
        )


def run(args: argparse.Namespace) -> int:
    import contextlib
    import io

    from torch_kvq import distributed

    if args.tp > 1 and not distributed.under_torchrun():
        _check_tp(args)
        print(f"kvq demo: starting {args.tp} ranks (torchrun --standalone) ...", file=sys.stderr)
        return distributed.relaunch(args.tp, ["-m", "torch_kvq.cli", *args.argv])
    if args.tp == 1:
        return _run(args, None)
    import os

    import torch.distributed as dist

    tp = distributed.init_tensor_parallel("gloo", "cpu")
    try:
        if tp.size != args.tp:
            raise CommandError(f"--tp {args.tp}, but torchrun started {tp.size} ranks")
        mute = tp.rank != 0  # rank 0 prints; every rank runs the same steps
        out = contextlib.redirect_stdout(io.StringIO()) if mute else contextlib.nullcontext()
        err = contextlib.redirect_stderr(io.StringIO()) if mute else contextlib.nullcontext()
        with out, err:
            code = _run(args, tp)
        dist.barrier()  # both ranks done before either tears the group down
    finally:
        dist.destroy_process_group()
    # This process is a torchrun rank with nothing left to do: it leaves without the
    # interpreter's teardown, in which a C++ thread of torch.distributed aborted a rank about one
    # run in three on torch 2.13 ("terminate called without an active exception", SIGABRT, after
    # all output), and still about one in twelve with the group destroyed above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(args: argparse.Namespace, tp: Any) -> int:
    import torch

    from torch_kvq.cli.sources import kv_config_from_args, model_from_args, trained_tokenizer
    from torch_kvq.cli.tables import WIDTH, layer_table
    from torch_kvq.models import generate
    from torch_kvq.spec import KVCacheConfig

    kind = "trained" if args.model is not None else "preset"
    args.compile = args.compile or DEFAULT_COMPILE[kind]
    args.max_new_tokens = args.max_new_tokens or DEFAULT_NEW_TOKENS[kind]
    kv = kv_config_from_args(args)
    plain = KVCacheConfig(page_size=args.page_size)
    tok = None
    if kind == "trained":  # one model, its cache configured twice: all-bf16 first
        print(f"kvq demo: loading {args.model} ...", file=sys.stderr)
        # bf16: the CPU reads half the weights per token (Gemma's 262k-row LM head dominates)
        model = ref_model = model_from_args(args, kv, dtype=torch.bfloat16)
        tok = trained_tokenizer(args.model)
        prompts = [tok(p).input_ids for p in PROMPTS]
        model.configure_kv(plain)
    else:
        model = model_from_args(args, kv, tp=tp)  # ValueError on bad rules -> exit 2
        ref_model = model_from_args(args, plain, tp=tp)
        gen = torch.Generator().manual_seed(args.seed)
        vocab = model.config.vocab_size
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    ref_label = f"all-{str(ref_model.dtype).removeprefix('torch.')} cache"

    t0 = time.perf_counter()
    bar, on_step = _bar(f"{ref_label}, eager", args.max_new_tokens)
    with bar:
        ref = generate(
            ref_model, prompts, args.max_new_tokens, on_step=on_step, prefill_logits=True
        )
    ref_kib = sum(a.kv_cache.nbytes for a in ref_model.attention_layers) / 1024
    if kind == "trained":
        model.configure_kv(kv)
    forward = None
    if args.compile != "off":
        forward = torch.compile(model, backend=_kvq_backend(args.compile))
    t1 = time.perf_counter()
    step_times: list[float] = []
    bar, on_step = _bar(
        f"quantized ({args.compile})", args.max_new_tokens, step_times, forward is not None
    )
    with bar:
        out = generate(
            model,
            prompts,
            args.max_new_tokens,
            forward=forward,
            force_tokens=ref.tokens,
            on_step=on_step,
            prefill_logits=True,
        )
    t2 = time.perf_counter()

    columns = {
        a.layer_name: {"cache KiB": f"{a.kv_cache.nbytes / 1024:.0f}"}
        for a in model.attention_layers
    }
    report = None
    if args.compile != "off":
        from torch_kvq.passes import last_report

        report = last_report()
    if report is not None and not args.wide:  # --wide: the pass report's per-layer table
        for name, cols in columns.items():
            cols["fused"] = ", ".join(report.fused(name)) or "nothing"
    elif report is None:  # eager: what the passes would fuse (the same decisions, unrun)
        from torch_kvq.debug.plan import layer_plan

        for row in layer_plan(model.kv_specs):
            columns[row["name"]]["the passes would fuse"] = row["fuses"]
    print(f"kvq demo: {model_label(args)}, compile {args.compile}, seed {args.seed}")
    print(
        f"KV config: kv_cache_dtype={kv.kv_cache_dtype!r}, skip_layers={kv.skip_layers}, "
        f"page_size {kv.page_size}"
    )
    if tp:
        print(f"tensor-parallel over {tp.size} ranks (this table: rank 0's heads)")
    print()
    print(layer_table(model.kv_specs, columns, kv.skip_layers, wide=args.wide, also=("cache KiB",)))
    if report is not None:
        print()
        if args.wide:
            print(report.format())
        else:
            print(textwrap.fill(report.summary(), WIDTH))
            print("(--wide: the pass report per layer, with why a fusion passed a layer over)")
    print()
    agree = total = 0
    if tok is None:
        print(
            "The weights are random (fixed seed), so the generated tokens mean nothing and often "
            "repeat one token\n(e.g. [184, 184, ...]); what the demo checks is that the quantized "
            "model agrees with all-bf16."
        )
    for i, p in enumerate(prompts):
        own = out.logits[i].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(own, ref.tokens[i]))
        total += len(own)
        if tok is not None:
            print(_side_by_side(i, tok, PROMPTS[i], ref.tokens[i], own, ref_label))
            continue
        head = f"prompt {i} ({len(p)} tokens): "
        print(f"{head}bf16 greedy      {ref.tokens[i]}\n{' ' * len(head)}quantized greedy {own}")
    prefill = max(
        (a - b).abs().max().item() for a, b in zip(out.prefill_logits, ref.prefill_logits)
    )
    steps = (out.logits[:, 1:] - ref.logits[:, 1:]).abs()  # step 0 is the prefill's last row
    decode = f"{steps.max().item():.4f}" if steps.numel() else "n/a"
    scale = max(
        max(p.abs().max().item() for p in ref.prefill_logits), ref.logits.abs().max().item()
    )
    kib = sum(a.kv_cache.nbytes for a in model.attention_layers) / 1024
    print()
    print(
        f"max |logit diff| vs the {ref_label}: prefill {prefill:.4f}, decode {decode} "
        f"(max |logit| {scale:.2f})"
    )
    print(f"next-token agreement {agree}/{total} (the quantized run fed the reference's tokens)")
    print(f"KV cache: {kib:.0f} KiB vs {ref_kib:.0f} KiB with the {ref_label}")
    first, rest = step_times[:2], step_times[2:]
    print(
        f"timings: {ref_label} eager {t1 - t0:.2f} s; quantized ({args.compile}) "
        f"{t2 - t1:.2f} s:\n  prefill + first decode {sum(first):.2f} s"
        + (" (each includes its compile)" if args.compile != "off" else "")
        + (
            f", then {len(rest)} decode step{'s' if len(rest) != 1 else ''} at "
            f"{1000 * sum(rest) / len(rest):.1f} ms each"
            if rest
            else ""
        )
    )
    if next(model.parameters()).device.type == "cpu":
        print(
            "(CPU timings with the reference kernel, a correctness path: they say nothing about "
            "speed on a GPU.)"
        )
    return 0


def _side_by_side(
    i: int, tok: Any, prompt: str, ref: list[int], own: list[int], ref_label: str
) -> str:
    """A prompt and its two greedy continuations, wrapped to the table width."""
    from torch_kvq.cli.tables import WIDTH

    same = sum(a == b for a, b in zip(ref, own))
    lines = [f"prompt {i}: {prompt!r}"]
    for label, ids in ((ref_label, ref), ("quantized cache", own)):
        text = f"{label + ':':<22}..." + " ".join(tok.decode(ids).split())  # newlines as spaces
        lines.append(textwrap.fill(text, WIDTH, initial_indent="  ", subsequent_indent=" " * 27))
    lines.append(
        f"  (the quantized cache's next token at each step, fed the other's tokens: {same} of "
        f"{len(own)} agree)"
    )
    return "\n".join(lines)
