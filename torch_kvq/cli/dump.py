"""``kvq dump --out DIR``: everything needed to see what the passes did, as files.

Layout of DIR::

    index.html                  start here: per graph (prefill / decode), what fused per layer, the
                                passes in the order they ran with their pictures inline
    passes/graph_NNN/           one folder per compiled graph (written by the pass manager)
        <pass>.before.py / .after.py / .diff / .after.svg, report.txt, report.json
    depyf/                      depyf's dumps of the Dynamo / AOT / Inductor stages
    plan.txt                    the per-layer plan (``kvq inspect``), then the caches the model
                                holds (``debug.plan.format_caches``: dtype, shape, bytes per layer)

The pass manager writes ``passes/`` whenever a dump folder is set, from ``kvq dump``, from
``make_kvq_backend(dump_dir=...)``, or from the ``TORCH_KVQ_DUMP_DIR`` environment variable.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch_kvq.cli.args import SUBCOMMANDS, CommandError, add_model_args, model_label

if TYPE_CHECKING:  # torch is imported by the runner only: ``kvq dump --help`` stays fast
    from torch_kvq.passes.report import GraphReport


@contextlib.contextmanager
def _depyf_context(folder: Path, want: bool) -> Iterator[None]:
    """depyf's ``prepare_debug`` if asked for; a clear error if the ``debug`` extra is missing.
    depyf's warning to run the code several times is silenced: the dump runs what it runs (the
    decode graph is dumped by the passes), so a user cannot act on it."""
    if not want:
        yield
        return
    try:
        import depyf
    except ImportError as e:
        raise CommandError(
            f"depyf is not installed ({e}); install the debug extra: pip install 'torch-kvq[debug]', "
            "or pass --no-depyf"
        ) from None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?s).*You are trying to debug `torch.compile`")
        with depyf.prepare_debug(str(folder)):
            yield


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "dump",
        help=SUBCOMMANDS["dump"][1],
        description=(
            "Compile a model (a preset or --hf FAMILY) with kvq_backend, run a prefill and a decode step, and write "
            "into --out: per-pass before/after code, diffs, SVG pictures and stats for every "
            "compiled graph, depyf's Dynamo/AOT/Inductor stage dumps, the per-layer plan, and an "
            "index.html linking them."
        ),
    )
    add_model_args(p)
    p.add_argument(
        "--out", type=Path, required=True, help="output folder (created; must be writable)"
    )
    p.add_argument(
        "--inner",
        choices=("inductor", "eager"),
        default="inductor",
        help="inductor (default): the real compile; eager: passes only, no codegen (seconds)",
    )
    p.add_argument("--no-depyf", action="store_true", help="skip depyf's stage dumps")
    p.set_defaults(func=run)


def _prepare_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".kvq_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise CommandError(f"cannot write to --out {str(out)!r}: {e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    import torch

    from torch_kvq.cli.sources import kv_config_from_args, model_from_args
    from torch_kvq.debug.dump_index import write_index
    from torch_kvq.debug.plan import format_caches, format_plan, layer_plan
    from torch_kvq.models import generate
    from torch_kvq.passes import make_kvq_backend
    from torch_kvq.progress import Progress

    out: Path = args.out
    _prepare_out(out)
    kv = kv_config_from_args(args)
    model = model_from_args(args, kv)
    plan = format_plan(model.kv_specs, layer_plan(model.kv_specs), kv.skip_layers)
    caches = format_caches(model.attention_layers)
    (out / "plan.txt").write_text(f"{plan}\n\ncaches of this model:\n{caches}\n")
    backend = make_kvq_backend(
        inner=args.inner, dump_dir=out / "passes", config_patches={"fx_graph_cache": False}
    )
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (7, 19)
    ]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    phases: dict[str, str] = {}  # dump folder name -> "prefill" / "decode"
    reports = []
    with Progress("kvq dump", 2, unit="calls") as bar:
        # depyf watches the first (prefill) compile only: on torch 2.13 its decompiler recurses
        # without end on the recompiled decode frame (depyf 0.20). The decode graph is still dumped.
        bar.update(status="prefill call (depyf watching)")
        seen = _last_graph_id()  # recent_reports() keeps the newest 64: count by graph id
        with _depyf_context(out / "depyf", not args.no_depyf):
            generate(model, prompts, 1, forward=compiled)
        reports += _label(seen, "prefill", phases)
        bar.update(1, status="decode call")
        seen = _last_graph_id()
        generate(model, prompts, 2, forward=compiled)
        reports += _label(seen, "decode", phases)
        bar.update(2, status="writing index.html")
        title = (
            f"{model_label(args)}, kv_cache_dtype {kv.kv_cache_dtype!r}, "
            + (f"layer_modes {kv.layer_modes}, " if kv.layer_modes else "")
            + f"skip_layers {kv.skip_layers or 'none'}, inner compiler {args.inner}; prompts of "
            f"{', '.join(str(len(p)) for p in prompts)} tokens"
        )
        index = write_index(out, phases, title)
    print(f"kvq dump: {len(reports)} compiled graph(s); per-pass dumps in {out / 'passes'}")
    for rep in reports:
        print()
        print(rep.format())
    print()
    print(f"open {index}")
    return 0


def _last_graph_id() -> int:
    from torch_kvq.passes import recent_reports

    return max((r.graph_id for r in recent_reports()), default=-1)


def _label(last_id: int, phase: str, phases: dict[str, str]) -> list[GraphReport]:
    """The reports of the graphs compiled since graph ``last_id`` (one call's), their dump
    folders recorded as ``phase`` in ``phases``."""
    from torch_kvq.passes import recent_reports

    new = [r for r in recent_reports() if r.graph_id > last_id]
    for r in new:
        if r.dump_dir is not None:
            phases[Path(r.dump_dir).name] = phase
    return new
