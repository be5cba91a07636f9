"""scripts/gate_rest.py: the GPU tests an interrupted gate did not reach, and one record for both
parts (runs 65-66 of 2026-12-01 are the real case: 349 + 54 of 404)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from gate_rest import counts, merge, reported  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
RECORD = """commit abc1234
torch_kvq sha256 00
command python3 -m pytest -m "gpu" -n 4 tests/
result =========== 353 passed, 1 skipped, 29 warnings in 523.40s (0:08:43) ============
"""


def test_reported_reads_verbose_lines_with_and_without_xdist() -> None:
    log = (
        "[gw0] [  0%] PASSED tests/a/test_x.py::test_one[1-2] \n"
        "[gw3] [ 50%] FAILED tests/a/test_x.py::test_two \n"
        "tests/b/test_y.py::test_three SKIPPED (needs 2 GPUs)\n"
        "tests/b/test_y.py::test_four ERROR\n"
        "FAILED tests/a/test_x.py::test_two - AssertionError\n"
        "collected 5 items / tests/b/test_y.py::test_five\n"
    )
    assert reported(log) == {
        "tests/a/test_x.py::test_one[1-2]", "tests/a/test_x.py::test_two",
        "tests/b/test_y.py::test_three", "tests/b/test_y.py::test_four",
    }  # fmt: skip


def test_merge_sums_the_two_parts() -> None:
    rest = "log...\n========= 49 passed, 1 failed, 42 warnings in 129.50s (0:02:09) =========\n"
    got = merge(RECORD, rest, "python3 -m pytest -m gpu <50 ids>").splitlines()
    assert got[0] == "commit abc1234"
    assert got[3].startswith("part 1 ===") and "353 passed, 1 skipped" in got[3]
    assert got[-3] == "command python3 -m pytest -m gpu <50 ids>"
    assert got[-2].startswith("part 2 ===") and "49 passed, 1 failed" in got[-2]
    assert got[-1] == "result 402 passed, 1 skipped, 1 failed (parts 1 and 2)"
    assert counts("== 1 error, 2 errors, 3 xfailed in 1s ==") == {"errors": 3, "xfailed": 3}
    with pytest.raises(ValueError, match="no 'result' line"):
        merge("commit abc\n", rest, "x")
    with pytest.raises(ValueError, match="no pytest closing line"):
        merge(RECORD, "KeyboardInterrupt\n", "x")


def test_merge_counts_what_an_interrupted_second_part_missed() -> None:
    """The fifty-second session's second part was stopped at 67%: its record must not read as a
    whole gate."""
    rest = (
        "[gw0] [ 50%] PASSED tests/a/test_x.py::test_one[1] \n"
        "[gw1] [ 60%] FAILED tests/a/test_x.py::test_two \n"
        "!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!\n"
        "========= 1 passed, 1 failed in 400.00s (0:06:40) =========\n"
    )
    wanted = "tests/a/test_x.py::test_one[1]\ntests/a/test_x.py::test_two\ntests/b/test_y.py::test_three\n"
    got = merge(RECORD, rest, "x", wanted).splitlines()
    assert (
        got[-1] == "result 354 passed, 1 skipped, 1 failed (parts 1 and 2; 1 GPU tests not reached)"
    )
    whole = merge(RECORD, rest, "x", "\n".join(wanted.split()[:2])).splitlines()
    assert whole[-1] == "result 354 passed, 1 skipped, 1 failed (parts 1 and 2)"


def test_missing_lists_what_run_65_did_not_reach() -> None:
    """The real log of run 65 against this tree's GPU tests: the 54 that run 66 then ran (and any
    GPU test added since), none that the log reports."""
    log = RESULTS / "h200_2026-12-01_run65_gpu_test_log.txt"
    got = subprocess.run([sys.executable, str(ROOT / "scripts" / "gate_rest.py"), "missing", str(log)],
                         capture_output=True, text=True, check=True, timeout=600, cwd=ROOT).stdout  # fmt: skip
    # the log names the tests where they were then; issue 30 moved some (tests mirror the package)
    moved = (
        ("tests/compile/", "tests/passes/"),
        ("tests/attention/test_triton_", "tests/attention/triton_programs/test_triton_"),
    )
    text = (RESULTS / "h200_2026-12-01_run66_tests_not_reached_in_run65.txt").read_text()
    for old, new in moved:
        text = text.replace(old, new)
    want = set(text.split())
    assert len(want) == 54 and want <= set(got.split())
    assert not set(got.split()) & reported(log.read_text())


def test_merge_adds_a_third_part_and_counts_a_killed_log() -> None:
    """A gate in three calls sums into one record; a part killed before pytest's closing line
    (the fifty-second session's second call) is counted from its ``-v`` lines."""
    rest = "log...\n========= 49 passed, 1 failed, 42 warnings in 129.50s (0:02:09) =========\n"
    two = merge(RECORD, rest, "second", "")
    killed = (
        "[gw0] [ 50%] PASSED tests/a/test_x.py::test_one[1] \n"
        "[gw1] [ 60%] FAILED tests/a/test_x.py::test_two \n"
        "tests/b/test_y.py::test_three SKIPPED (needs 2 GPUs)\n"
        "FAILED tests/a/test_x.py::test_two - AssertionError\n"
    )
    wanted = (
        "tests/a/test_x.py::test_one[1]\ntests/a/test_x.py::test_two\ntests/c/test_z.py::test_four"
    )
    got = merge(two, killed, "third", wanted).splitlines()
    assert [line.split(" ===")[0] for line in got if line.startswith("part ")] == [
        "part 1", "part 2", "part 3 1 failed, 1 passed, 1 skipped (no pytest closing line: "
        "counted from the log's -v lines)",
    ]  # fmt: skip
    assert sum(line.startswith("result ") for line in got) == 1
    assert (
        got[-1] == "result 403 passed, 2 skipped, 2 failed (parts 1 to 3; 1 GPU tests not reached)"
    )
    with pytest.raises(ValueError, match="no pytest closing line"):
        merge(two, "Killed\n", "x")


def test_merge_sums_the_real_three_part_h100_run() -> None:
    """Sessions 52-53's three H100 calls (the second killed at 67%) into one record: its file in
    results/ is this merge."""
    part = lambda name: (RESULTS / name).read_text()  # noqa: E731
    two = merge(part("h100_2026-12-07_190fd4e_session52_gpu_suite_part1.txt"),
                part("h100_2026-12-07_190fd4e_session52_gpu_tests_rest_log.txt"), "2")  # fmt: skip
    got = merge(two, part("h100_2026-12-08_9ef9aff_session53_gpu_tests_rest_log.txt"), "3")
    assert got.splitlines()[-1] == "result 922 passed, 2 skipped, 0 failed (parts 1 to 3)"
    kept = part("h100_2026-12-08_190fd4e_sessions52-53_gpu_suite_3parts.txt").splitlines()
    assert [ln for ln in kept if not ln.startswith("command ")] == [
        ln for ln in got.splitlines() if not ln.startswith("command ")
    ]
