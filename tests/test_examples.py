"""Every script in examples/ runs to completion as a subprocess, so none rots.

An example that needs a GPU says so with a line ``# kvq-example: gpu``; it is marked gpu and
skips without CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _param(path: Path):
    if "# kvq-example: gpu" in path.read_text():
        marks = [
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ]
        return pytest.param(path, id=path.name, marks=marks)
    return pytest.param(path, id=path.name)


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"quickstart.py", "fusion_attn_scenario.py"} <= names


@pytest.mark.parametrize("path", [_param(p) for p in EXAMPLES])
def test_example_runs(path: Path, tmp_path: Path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, f"{path.name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert out.stdout.strip(), f"{path.name} printed nothing"
    if path.name in ("quickstart.py", "fusion_attn_scenario.py"):
        assert "fused quant+write" in out.stdout and "kvq graph" in out.stdout
