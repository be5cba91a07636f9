"""The pass manager's dump files: per compiled graph, one folder ``<dump_dir>/graph_NNN/`` with
``<pass>.before.py`` / ``.after.py`` (readable code), ``<pass>.diff`` and ``<pass>.after.svg``
(``graph_svg``), then ``report.txt`` / ``report.json``.

``kvq dump`` (``torch_kvq.cli.dump``) adds depyf's files and an index.html on top.
"""

from __future__ import annotations

import difflib
import time
from pathlib import Path

from torch import fx

from torch_kvq.passes.graph_svg import graph_to_svg
from torch_kvq.passes.report import GraphReport


class PassDumper:
    """Writes one compiled graph's dump folder; ``seconds`` is the time spent writing (the
    manager leaves it out of the passes' time)."""

    def __init__(self, dump_dir: Path, graph_id: int) -> None:
        i = graph_id
        while (dump_dir / f"graph_{i:03d}").exists():
            i += 1
        self.folder = dump_dir / f"graph_{i:03d}"
        self.folder.mkdir(parents=True)
        self.seconds = 0.0

    def before(self, pass_name: str, graph: fx.Graph) -> None:
        t0 = time.perf_counter()
        (self.folder / f"{pass_name}.before.py").write_text(graph_text(graph))
        self.seconds += time.perf_counter() - t0

    def after(self, pass_name: str, graph: fx.Graph) -> None:
        """The code after ``pass_name``, its diff against the code before, and its picture."""
        t0 = time.perf_counter()
        before = self.folder / f"{pass_name}.before.py"
        after = self.folder / f"{pass_name}.after.py"
        after.write_text(graph_text(graph))
        if before.exists():
            diff = difflib.unified_diff(
                before.read_text().splitlines(keepends=True),
                after.read_text().splitlines(keepends=True),
                before.name,
                after.name,
            )
            (self.folder / f"{pass_name}.diff").write_text("".join(diff))
        (self.folder / f"{pass_name}.after.svg").write_text(
            graph_to_svg(graph, f"{self.folder.name}: after {pass_name}")
        )
        self.seconds += time.perf_counter() - t0

    def report(self, rep: GraphReport) -> None:
        (self.folder / "report.txt").write_text(rep.format() + "\n")
        (self.folder / "report.json").write_text(rep.to_json() + "\n")


def graph_text(graph: fx.Graph) -> str:
    """The readable Python code of ``graph`` (``print_readable`` of its module, if it has one)."""
    gm = graph.owning_module
    return gm.print_readable(print_output=False) if isinstance(gm, fx.GraphModule) else str(graph)
