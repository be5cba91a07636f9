"""The ``kvq`` command: ``kvq <subcommand> ...``; the top layer of torch_kvq (nothing imports it).

Each subcommand is a module of this package with ``add_parser(subparsers)``, which adds its parser
and sets ``func`` (``args -> exit code``). To add one, write the module and list it in
``args.SUBCOMMANDS`` (name -> module, one-line help). The options every subcommand shares (the
model source ``--preset`` | ``--hf`` | ``--hf-config``, the KV config) and ``CommandError`` are in
``args``; ``sources`` builds the model they name. ``kvq --help`` imports no subcommand module (nor
torch): the list is built from ``SUBCOMMANDS``; only the subcommand named on the command line is
imported and gets its full parser, so torch imports stay inside the runners.
Bad input a subcommand finds late (a ``ValueError`` from our APIs, a ``CommandError``, a missing
file or optional package) is
printed as ``kvq <subcommand>: error: <message>`` with exit code 2, like argparse's own errors.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable, Sequence

from torch_kvq.cli.args import SUBCOMMANDS, CommandError, resolve_source


def build_parser(load: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``kvq`` parser. ``load``: the subcommands to give their full parsers (importing their
    modules); the others get a stub with just their help line. None (default): all of them."""
    from torch_kvq import __version__

    parser = argparse.ArgumentParser(
        prog="kvq", description="Per-layer KV-cache quantization for torch.compile: tools."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_line) in SUBCOMMANDS.items():
        if load is None or name in load:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_line)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvq``; returns the exit code (argparse usage errors exit 2 via SystemExit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The top-level parser's only options (--help, --version) take no value, so the first
    # non-option word is the subcommand: build only its parser.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(load=[chosen] if chosen in SUBCOMMANDS else []).parse_args(argv)
    args.argv = argv  # what a subcommand re-runs on N ranks (``kvq demo --tp N``)
    resolve_source(args)
    try:
        return int(args.func(args) or 0)
    except (ValueError, CommandError, FileNotFoundError, ImportError) as e:
        # ImportError: a missing optional extra (the models extra's loaders name what to install)
        print(f"kvq {args.command}: error: {e}", file=sys.stderr)
        return 2
