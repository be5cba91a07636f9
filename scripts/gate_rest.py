"""The GPU gate in parts: which GPU tests an interrupted run did not reach, and one record for all.

A ``tests`` step that must JIT-build FlashInfer's modules does not fit one 600 s device call (run
59 of 2026-12-01: 353 of 404 tests in 520 s). ``scripts/gpu_run.sh rest`` then runs the tests its
log does not report, and this script gives both halves:

    python3 scripts/gate_rest.py missing out/gpu_test_log.txt [more logs]   # test ids, one a line
    python3 scripts/gate_rest.py merge out/gpu_suite.txt out/gpu_test_log_rest.txt "<command>" \
        [out/tests_not_reached.txt]

``missing`` collects ``pytest -m gpu tests/`` (``--collect-only``, here: no GPU needed) and prints
the ids no log reports with an outcome (the ``-v`` lines ``tests/...::name PASSED``, with or
without xdist's ``[gw0] [ 5%]`` prefix). ``merge`` prints the first part's record (``gpu_run.sh``'s
``gpu_suite.txt``) with its result as ``part 1``, the second log's closing line as ``part 2`` and a
``result`` line that sums both; given the second part's list of ids, the ``result`` line also
counts those its log does not report (an interrupted second part is not a whole gate). A record
that is already a merge gains ``part 3`` (and so on), so a gate in three calls sums into one
record; a log killed before pytest's closing line is counted from its ``-v`` lines, and says so.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

OUTCOME = re.compile(r"(?:^|\s)(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\s+(tests/\S+::\S+)")
OUTCOME_AFTER = re.compile(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")
CLOSING = re.compile(r"^=+ .*\b(passed|failed|errors?|skipped)\b.* =+$")


def outcomes(log: str) -> dict[str, str]:
    """Test id -> outcome (``PASSED``...) for each test a pytest ``-v`` log reports (a test the
    ``-rfE`` summary names again counts once)."""
    got = {m.group(2): m.group(1) for m in OUTCOME.finditer(log)}
    got |= {m.group(1): m.group(2) for line in log.splitlines() if (m := OUTCOME_AFTER.match(line))}
    return got


def reported(log: str) -> set[str]:
    """Test ids that a pytest ``-v`` log reports with an outcome."""
    return set(outcomes(log))


def collect_gpu_tests(root: Path) -> list[str]:
    """``pytest --collect-only -q -m gpu tests/``'s test ids, in collection order."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
         "no:cacheprovider", "tests/"],
        cwd=root, capture_output=True, text=True, timeout=600,
    ).stdout  # fmt: skip
    return [line.strip() for line in out.splitlines() if "::" in line and " " not in line.strip()]


def closing_line(log: str) -> str:
    """A pytest log's last summary line (``=== 3 passed, 1 skipped in 2.0s ===``)."""
    lines = [line.strip() for line in log.splitlines() if CLOSING.match(line.strip())]
    if not lines:
        raise ValueError("no pytest closing line (=== N passed ... ===) in the log")
    return lines[-1]


def counts(line: str) -> Counter:
    """Outcome counts of a closing line; 'error' and 'errors' both count as errors."""
    got: Counter = Counter()
    for n, what in COUNTS.findall(line):
        got["errors" if what.startswith("error") else what] += int(n)
    return got


def outcome_line(log: str) -> str:
    """The log's closing line, else (pytest killed before it) its ``-v`` outcomes counted."""
    try:
        return closing_line(log)
    except ValueError:
        got = Counter(outcomes(log).values())
        if not got:
            raise
        words = {"ERROR": "errors", "XFAIL": "xfailed", "XPASS": "xpassed"}
        text = ", ".join(f"{n} {words.get(k, k.lower())}" for k, n in sorted(got.items()))
        return f"{text} (no pytest closing line: counted from the log's -v lines)"


def merge(record: str, rest_log: str, command: str, wanted: str = "") -> str:
    """The earlier record with one more ``part N`` line and a summed ``result``; ``wanted``: this
    part's test ids, one a line (those the log misses are counted)."""
    lines = record.rstrip("\n").splitlines()
    first = next((line for line in lines if line.startswith("result ")), None)
    if first is None:
        raise ValueError("the record has no 'result' line (is it gpu_run.sh's gpu_suite.txt?)")
    parts = sum(line.startswith("part ") for line in lines)
    second = outcome_line(rest_log)
    total = counts(first.split(" (parts ")[0]) + counts(second)
    order = ("passed", "skipped", "failed", "errors", "xfailed", "xpassed")
    summed = ", ".join(f"{total[k]} {k}" for k in order if total[k] or k in ("passed", "failed"))
    if parts:  # a merged record: its parts stay, its result is replaced
        out = [line for line in lines if line is not first]
    else:
        out = [
            ("part 1 " + line.removeprefix("result ")) if line is first else line for line in lines
        ]
        parts = 1
    missed = {t for t in wanted.split() if "::" in t} - reported(rest_log)
    note = f"; {len(missed)} GPU tests not reached" if missed else ""
    which = "1 and 2" if parts == 1 else f"1 to {parts + 1}"
    out += [
        f"command {command}",
        f"part {parts + 1} {second}",
        f"result {summed} (parts {which}{note})",
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "missing":
        seen: set[str] = set()
        for log in argv[1:]:
            seen |= reported(Path(log).read_text(errors="replace"))
        root = Path(__file__).resolve().parent.parent
        print("\n".join(t for t in collect_gpu_tests(root) if t not in seen))
        return 0
    if len(argv) in (4, 5) and argv[0] == "merge":
        record, rest, *wanted = (Path(p).read_text(errors="replace") for p in argv[1:3] + argv[4:])
        sys.stdout.write(merge(record, rest, argv[3], *wanted))
        return 0
    print("\n\n".join(__doc__.split("\n\n")[1:3]), file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
