"""The docs build as a site and name only files that exist.

``mkdocs build --strict`` (mkdocs.yml: every link and anchor check warns, and strict fails on a
warning) catches a broken link between pages. Pages also name repository files in backticks,
code blocks and links, which mkdocs does not check: every such path that starts with one of
``PREFIXES`` must exist, in the README, ``docs/`` and ``benchmarks/README.md``. A path followed by
"(at <commit>)" or "(script at <commit>)" names a file of that commit (a deleted study script):
it must exist there, checked with git wherever the clone has that commit.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = ("torch_kvq/", "benchmarks/", "examples/", "scripts/", "tests/", "docs/")

CODE = re.compile(r"(`+)(.+?)\1", re.S)  # inline code and fenced blocks alike
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
AT_COMMIT = re.compile(r"\s*\((?:[^()]*?\bscript )?at ([0-9a-f]{7,40})\b")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(map(re.escape, PREFIXES)) + r")[\w./*-]*)")


def doc_files(root: Path = ROOT) -> list[Path]:
    return [
        root / "README.md",
        root / "benchmarks" / "README.md",
        *sorted((root / "docs").rglob("*.md")),
    ]


def mentions(text: str) -> list[tuple[str, str | None]]:
    """(repository path, commit or None) for every path named in code spans or blocks."""
    found = []
    for m in CODE.finditer(text):
        at = AT_COMMIT.match(text, m.end())
        for p in PATH.findall(m.group(2)):
            found.append((re.sub(r"[.,;:]+$", "", p), at.group(1) if at else None))
    return found


def links(text: str) -> list[str]:
    """Relative link and image targets, without their anchor."""
    out = []
    for target in LINK.findall(CODE.sub("", text)):
        if re.match(r"[a-z]+:|#", target):
            continue
        out.append(target.split("#")[0])
    return out


def git_has(root: Path, obj: str) -> bool:
    """``git cat-file -e obj`` in ``root``: the commit, or the file at a commit, exists."""
    args = ["git", "-C", str(root), "cat-file", "-e", obj]
    return subprocess.run(args, capture_output=True).returncode == 0


def dangling(files: list[Path], root: Path = ROOT) -> list[str]:
    """'file: path' for every named path or link target that does not exist."""
    bad = []
    for f in files:
        text = f.read_text()
        where = f.relative_to(root)
        for path, sha in mentions(text):
            if sha is not None:  # a clone without that commit (shallow) cannot check it
                if git_has(root, f"{sha}^{{commit}}") and not git_has(
                    root, f"{sha}:{path.rstrip('/')}"
                ):
                    bad.append(f"{where}: {path} (not in commit {sha})")
                continue
            hits = list(root.glob(path.rstrip("/"))) if "*" in path else [root / path]
            if (
                not hits
                or not all(h.exists() for h in hits)
                or (path.endswith("/") and not hits[0].is_dir())
            ):
                bad.append(f"{where}: {path}")
        for target in links(text):
            if not (f.parent / target).exists():
                bad.append(f"{where}: link {target}")
    return bad


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
           "-d", str(tmp_path / "site")]  # fmt: skip
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    assert (tmp_path / "site" / "performance" / "index.html").exists()


def test_every_named_path_exists() -> None:
    files = doc_files()
    assert len(files) > 10 and all(f.exists() for f in files)
    assert dangling(files) == []


def test_library_docstrings_name_existing_docs() -> None:
    """A module that sends its reader to a doc page or benchmark names one that exists."""
    named = re.compile(r"(?<![\w/])((?:docs|benchmarks)/[\w/.-]*\w)")
    bad = [
        f"{f.relative_to(ROOT)}: {p}"
        for f in sorted((ROOT / "torch_kvq").rglob("*.py"))
        for p in named.findall(f.read_text())
        if not (ROOT / p).exists()
    ]
    assert bad == []


def test_a_dangling_path_or_link_fails(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "torch_kvq").mkdir()
    (tmp_path / "torch_kvq" / "spec.py").write_text("")
    (tmp_path / "docs" / "ok.md").write_text("")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "See `torch_kvq/spec.py`, `torch_kvq/gone.py` and [ok](ok.md#x), [gone](gone.md).\n"
        "```bash\npython examples/missing.py --flag\n```\n"
        "Also `tests/test_x.py::test_y`, and `torch_kvq/spec.py:12`.\n"
    )
    assert dangling([page], tmp_path) == [
        "docs/page.md: torch_kvq/gone.py",
        "docs/page.md: examples/missing.py",
        "docs/page.md: tests/test_x.py",
        "docs/page.md: link gone.md",
    ]


def test_a_path_at_a_commit_must_exist_there(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        cmd = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "study.py").write_text("")
    git("add", "-A")
    git("commit", "-qm", "a study")
    sha = git("rev-parse", "--short=7", "HEAD")
    git("rm", "-q", "benchmarks/study.py")
    git("commit", "-qm", "the study leaves")
    page = tmp_path / "page.md"
    page.write_text(
        f"`benchmarks/study.py` (script at {sha}), `benchmarks/never.py` (at {sha}; gone), "
        "`benchmarks/study.py` today\n"
    )
    assert dangling([page], tmp_path) == [
        f"page.md: benchmarks/never.py (not in commit {sha})",
        "page.md: benchmarks/study.py",
    ]
