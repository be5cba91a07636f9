"""Progress on stderr for the long steps a person waits for (compiles, dumps, accuracy, benchmarks).

``Progress(label, total)`` draws one line, redrawn every second by a background thread, saying
what is happening and for how long::

    quantized (kvq) [###---------------------] 1/8 steps: decode step 2 > compiling a graph ... 14 s

``activity(what)`` says what a long step inside it does: on the innermost open ``Progress`` line,
or on a line of its own when none is open (the kvq backend wraps every compile in one).
Nothing is drawn when stderr is not a terminal (logs, pipes, CI, pytest's capture), unless
``TORCH_KVQ_PROGRESS=1``; ``TORCH_KVQ_PROGRESS=0`` turns it off everywhere. No dependency, no
torch import.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

ENV = "TORCH_KVQ_PROGRESS"  # "0": never draw; "1": draw even when stderr is not a terminal
BAR_WIDTH = 24
_active: list[Progress] = []
_lock = threading.RLock()


def enabled(stream: TextIO) -> bool:
    """Whether progress is drawn on ``stream``: a terminal, unless ``TORCH_KVQ_PROGRESS`` says."""
    env = os.environ.get(ENV, "")
    if env in ("0", "1"):
        return env == "1"
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """One progress line: ``label``, a bar when ``total`` is given, the current status and its
    seconds. A context manager; ``update(done, status)`` moves it; ``close()`` ends the line."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        *,
        unit: str = "steps",
        stream: TextIO | None = None,
        interval: float = 1.0,
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.done = 0
        self.start = time.perf_counter()
        self._base: tuple[str, float] | None = None  # (text, since): what the steps do now
        self._stack: list[tuple[str, float]] = []  # open activities, innermost last
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.enabled = enabled(self.stream)
        with _lock:
            _active.append(self)
        if self.enabled:
            self._thread = threading.Thread(target=self._tick, name="kvq-progress", daemon=True)
            self._thread.start()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, done: int | None = None, status: str | None = None) -> None:
        """Set the count done and / or the base status (what the steps are doing now)."""
        with _lock:
            if done is not None:
                self.done = done
            if status is not None:
                self._base = (status, time.perf_counter())
        self._draw()

    def push(self, status: str) -> None:
        """Open an activity: shown after the base status until ``pop``."""
        with _lock:
            self._stack.append((status, time.perf_counter()))
        self._draw()

    def pop(self) -> None:
        with _lock:
            if self._stack:
                self._stack.pop()
        self._draw()

    def echo(self, text: object) -> None:
        """Print ``text`` on stdout above the progress line (which a plain print would split)."""
        with _lock:
            if self.enabled and not self._closed:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            print(text, flush=True)
        self._draw()

    def line(self) -> str:
        """The text drawn now (without the carriage return)."""
        now = time.perf_counter()
        with _lock:
            text = self.label + self._bar()
            shown = ([self._base] if self._base else []) + self._stack
            status = " > ".join(text for text, _ in shown)
            since = shown[-1][1] if shown else self.start
        if status:
            text += f": {status}"
        return f"{text} ... {now - since:.0f} s"

    def close(self) -> None:
        """Stop redrawing; end the line with the total time (terminal only)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with _lock:
            if self in _active:
                _active.remove(self)
            if self.enabled:
                took = time.perf_counter() - self.start
                self._write(f"{self.label}{self._bar()}: done in {took:.1f} s", end="\n")

    def _bar(self) -> str:
        if not self.total:
            return ""
        filled = BAR_WIDTH * min(self.done, self.total) // self.total
        return f" [{'#' * filled:<{BAR_WIDTH}}] {self.done}/{self.total} {self.unit}"

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            self._draw()

    def _draw(self) -> None:
        if self.enabled and not self._closed:
            with _lock:
                self._write(self.line())

    def _write(self, text: str, end: str = "") -> None:
        width = shutil.get_terminal_size((100, 20)).columns - 1
        if len(text) > width:  # a wrapped line cannot be redrawn in place
            text = text[: max(width - 3, 10)] + "..."
        self.stream.write(f"\r{text}\x1b[K{end}")
        self.stream.flush()


@contextlib.contextmanager
def activity(what: str, stream: TextIO | None = None) -> Iterator[None]:
    """Say ``what`` a long step inside the block does: on the innermost open ``Progress`` line,
    else on a ticking line of its own ("what ... 12 s", then "what: done in 41.3 s")."""
    with _lock:
        outer = _active[-1] if _active else None
    if outer is None:
        with Progress(what, stream=stream):
            yield
        return
    outer.push(what)
    try:
        yield
    finally:
        outer.pop()
