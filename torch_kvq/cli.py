"""The ``kvq`` command: ``kvq <subcommand> ...``.

Each subcommand lives in its own module with ``add_parser(subparsers)``, which adds its parser and
sets ``func`` (``args -> exit code``). To add one, write the module and list it in ``SUBCOMMANDS``.
Bad input a subcommand finds late (a ``ValueError`` from our APIs, or a ``CommandError``) is
printed as ``kvq <subcommand>: error: <message>`` with exit code 2, like argparse's own errors.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMANDS: tuple[str, ...] = ("torch_kvq.demo",)


class CommandError(Exception):
    """A subcommand's clean failure (no traceback): printed, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    from torch_kvq import __version__

    parser = argparse.ArgumentParser(
        prog="kvq", description="Per-layer KV-cache quantization for torch.compile: tools."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvq``; returns the exit code (argparse usage errors exit 2 via SystemExit)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, CommandError) as e:
        print(f"kvq {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
