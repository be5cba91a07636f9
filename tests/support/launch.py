"""Start a script on N local processes with torchrun (gloo on the CPU), bounded in time: a hang
fails the test instead of blocking CI. Shared by the distributed, example and benchmark tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TP_WORKER = ROOT / "tests" / "distributed" / "tp_worker.py"  # a rank's side of the TP tests


def torchrun(
    script: str | Path, *args: str, nproc: int = 2, timeout: float = 240, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N script args`` (a free
    rendezvous port each time, so xdist workers can launch side by side); the whole process group
    is killed after ``timeout`` seconds and the test fails, showing the output so far."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(script), *args]  # fmt: skip
    return run_bounded(cmd, timeout, cwd)


def run_bounded(
    cmd: list[str], timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own process group (PYTHONPATH: this checkout); kill the group and fail
    the test after ``timeout`` seconds. stdout and stderr together in ``.stdout``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        cmd, cwd=cwd or ROOT, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank it started
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} still running after {timeout} s (a hang?):\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def launch(scenario: str, tmp_path: Path, timeout: float) -> list[dict]:
    """Run ``tp_worker.py``'s ``scenario`` on 2 ranks; each rank's JSON result."""
    out = torchrun(TP_WORKER, scenario, str(tmp_path), timeout=timeout)
    assert out.returncode == 0, out.stdout[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, res in enumerate(ranks):
        assert res["ok"], f"rank {r}:\n{res.get('traceback')}"
    return ranks
