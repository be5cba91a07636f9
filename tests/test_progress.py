"""torch_kvq.progress: a ticking line on a terminal, nothing otherwise."""

from __future__ import annotations

import io
import time

from torch_kvq import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def lines(stream: io.StringIO) -> list[str]:
    text = stream.getvalue().replace("\x1b[K", "")
    return [line for line in text.replace("\r", "\n").split("\n") if line]


def test_quiet_when_not_a_terminal(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    stream = io.StringIO()  # isatty() is False: a pipe, a log, pytest's capture
    with progress.Progress("compiling", 3, stream=stream, interval=0.01) as bar:
        with progress.activity("inner step"):
            bar.update(2, status="decode")
            time.sleep(0.05)
    with progress.activity("alone", stream=stream):
        time.sleep(0.03)
    assert stream.getvalue() == ""


def test_terminal_gets_a_ticking_bar_with_the_activity(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    stream = Terminal()
    with progress.Progress("demo", 4, stream=stream, interval=0.01) as bar:
        bar.update(1, status="decode step 1")
        with progress.activity("compiling a graph"):
            time.sleep(0.05)  # the thread redraws meanwhile
            assert bar.line().startswith("demo [######")
            assert "1/4 steps: decode step 1 > compiling a graph ... 0 s" in bar.line()
        bar.update(4, status="done")
    drawn = lines(stream)
    assert sum("> compiling a graph" in line for line in drawn) >= 2  # redrawn while it ran
    assert drawn[-1].startswith("demo [########################] 4/4 steps: done in ")
    assert stream.getvalue().endswith("\n") and progress._active == []


def test_activity_without_a_bar_has_its_own_line(monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    stream = Terminal()
    with progress.activity("compiling: kvq passes + Inductor", stream=stream):
        time.sleep(0.01)
    drawn = lines(stream)
    assert drawn[-1].startswith("compiling: kvq passes + Inductor: done in ")


def test_env_forces_it_on_or_off(monkeypatch):
    monkeypatch.setenv(progress.ENV, "1")
    assert progress.enabled(io.StringIO())
    monkeypatch.setenv(progress.ENV, "0")
    assert not progress.enabled(Terminal())


def test_echo_prints_above_the_line(monkeypatch, capsys):
    monkeypatch.delenv(progress.ENV, raising=False)
    stream = Terminal()
    with progress.Progress("bench", 2, stream=stream, interval=10) as bar:
        bar.echo("| row 1 |")
    assert capsys.readouterr().out == "| row 1 |\n"
    assert "\r\x1b[K" in stream.getvalue()  # the line was cleared before the print
