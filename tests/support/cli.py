"""Running ``kvq`` in-process from tests."""

from __future__ import annotations

from torch_kvq import cli


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
