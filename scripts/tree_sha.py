"""sha256 over a folder's files (sorted relative paths and contents; __pycache__ left out).

The GPU gate's record (benchmarks/results/gpu_suite.txt) carries this for torch_kvq/, so a record
can be checked against the code it claims to have tested: ``python3 scripts/tree_sha.py torch_kvq``.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path


def tree_sha(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


if __name__ == "__main__":
    print(tree_sha(Path(sys.argv[1] if len(sys.argv) > 1 else "torch_kvq")))
