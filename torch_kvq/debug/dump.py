"""``kvq dump --out DIR``: everything needed to see what the passes did, as files.

Layout of DIR::

    index.html                  links to everything below
    passes/graph_NNN/           one folder per compiled graph (written by the pass manager)
        <pass>.before.py / .after.py / .diff / .after.svg, report.txt, report.json
    depyf/                      depyf's dumps of the Dynamo / AOT / Inductor stages
    plan.txt                    the per-layer plan (``kvq inspect``)

The pass manager writes ``passes/`` whenever a dump folder is set, from ``kvq dump``, from
``make_kvq_backend(dump_dir=...)``, or from the ``TORCH_KVQ_DUMP_DIR`` environment variable.
"""

from __future__ import annotations

import argparse
import contextlib
import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the runner only: ``kvq dump --help`` stays fast
    pass


def write_index(out: Path) -> Path:
    """Write ``out/index.html`` linking every file under ``out``, grouped by folder."""
    groups: dict[str, list[Path]] = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name != "index.html"):
        groups.setdefault(str(path.parent.relative_to(out)), []).append(path)
    parts = ["<!doctype html><meta charset=utf-8><title>kvq dump</title>", "<h1>kvq dump</h1>"]
    for folder, files in groups.items():
        parts.append(f"<h2>{html.escape(folder)}</h2><ul>")
        for f in files[:200]:
            rel = html.escape(str(f.relative_to(out)))
            parts.append(f'<li><a href="{rel}">{html.escape(f.name)}</a></li>')
            if f.suffix == ".svg" and f.name.startswith("cleanup"):
                parts.append(f'<li><img src="{rel}" style="max-width:100%"></li>')
        if len(files) > 200:
            parts.append(f"<li>... {len(files) - 200} more</li>")
        parts.append("</ul>")
    index = out / "index.html"
    index.write_text("\n".join(parts) + "\n")
    return index


def _depyf_context(folder: Path, want: bool) -> contextlib.AbstractContextManager[Any]:
    """depyf's ``prepare_debug`` if asked for; a clear error if the ``debug`` extra is missing."""
    if not want:
        return contextlib.nullcontext()
    from torch_kvq.cli_args import CommandError

    try:
        import depyf
    except ImportError as e:
        raise CommandError(
            f"depyf is not installed ({e}); install the debug extra: pip install 'torch-kvq[debug]', "
            "or pass --no-depyf"
        ) from None
    return depyf.prepare_debug(str(folder))


def add_parser(sub: Any) -> None:
    from torch_kvq.cli_args import add_model_args

    p = sub.add_parser(
        "dump",
        help="compile a model with kvq_backend and write per-pass dumps, diffs, SVGs, depyf files",
        description=(
            "Compile a preset model with kvq_backend, run a prefill and a decode step, and write "
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
    from torch_kvq.cli_args import CommandError

    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".kvq_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise CommandError(f"cannot write to --out {str(out)!r}: {e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    import torch

    from torch_kvq.cli_args import kv_config_from_args, model_from_args
    from torch_kvq.debug.plan import format_plan, layer_plan
    from torch_kvq.models import generate
    from torch_kvq.passes import make_kvq_backend, recent_reports

    out: Path = args.out
    _prepare_out(out)
    kv = kv_config_from_args(args)
    model = model_from_args(args, kv)
    (out / "plan.txt").write_text(format_plan(model.kv_specs, layer_plan(model.kv_specs)) + "\n")
    backend = make_kvq_backend(
        inner=args.inner, dump_dir=out / "passes", config_patches={"fx_graph_cache": False}
    )
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in (7, 19)
    ]
    last_id = max((r.graph_id for r in recent_reports()), default=-1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    # depyf watches the first (prefill) compile only: on torch 2.13 its decompiler recurses
    # without end on the recompiled decode frame (depyf 0.20). The decode graph is still dumped.
    with _depyf_context(out / "depyf", not args.no_depyf):
        generate(model, prompts, 1, forward=compiled)
    generate(model, prompts, 2, forward=compiled)
    reports = [r for r in recent_reports() if r.graph_id > last_id]
    index = write_index(out)
    print(f"kvq dump: {len(reports)} compiled graph(s); per-pass dumps in {out / 'passes'}")
    for rep in reports:
        print()
        print(rep.format())
    print()
    print(f"open {index}")
    return 0
