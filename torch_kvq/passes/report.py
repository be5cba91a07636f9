"""What the pass manager records per compiled graph, and ``last_report()`` to read it back.

Per pass: matches, time, and one decision per layer. Per layer: the decisions of every pass
(``"fused " + <the pass's fusion>`` such as ``"fused quant+write"``, ``"kept bf16 (skipped:
...)"``, ``"not fused: <reason>"``). The summary counts the fusions of the passes that ran.
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

FUSED_PREFIX = "fused "


@dataclass
class PassStats:
    """One pass on one graph: how many rewrites it made, its time, its per-layer decisions.

    ``fusion`` / ``writes_stamps``: the pass's class attributes (``KVQPass``), so that the
    summary counts the fusions that ran and the table leaves out the stamping pass.
    """

    name: str
    matches: int
    time_s: float
    decisions: dict[str, str] = field(default_factory=dict)
    fusion: str | None = None
    writes_stamps: bool = False


@dataclass
class GraphReport:
    """The record of one compiled graph.

    ``layers``: layer name -> ``{"mode", "kernel", "arch", "index"}`` for the layers of this graph.
    ``ops_before`` / ``ops_after``: kvq op counts (see ``passes.graph_utils.count_ops``).
    ``source``: ``"passes"``, or ``"fx graph cache hit"`` when Inductor reused a compiled graph
    and this report was recalled from the compile that made it.
    """

    graph_id: int
    layers: dict[str, dict[str, Any]]
    per_pass: dict[str, PassStats]
    ops_before: dict[str, int]
    ops_after: dict[str, int]
    time_s: float
    dump_dir: str | None = None
    source: str = "passes"

    @property
    def per_layer(self) -> dict[str, dict[str, str]]:
        """layer -> {pass name: decision}, layers in index order."""
        out: dict[str, dict[str, str]] = {name: {} for name in self.layers}
        for stats in self.per_pass.values():
            for layer, decision in stats.decisions.items():
                out.setdefault(layer, {})[stats.name] = decision
        return out

    def fused(self, layer: str) -> tuple[str, ...]:
        """The fusions applied to ``layer`` (each fusion pass's ``fusion``: ``"quant+write"``, ...)."""
        return tuple(
            d[len(FUSED_PREFIX) :]
            for d in self.per_layer.get(layer, {}).values()
            if d.startswith(FUSED_PREFIX)
        )

    def layers_fused(self, what: str) -> tuple[str, ...]:
        """Layers where the fusion ``what`` (e.g. ``"output quant"``) was applied."""
        return tuple(name for name in self.layers if what in self.fused(name))

    def summary(self) -> str:
        """The one log line per compiled graph."""
        modes = [str(info["mode"]) for info in self.layers.values() if info["mode"] != "none"]
        by_mode = "".join(f"{modes.count(m)} {m}, " for m in sorted(set(modes)))
        fused = ", ".join(
            f"{s.fusion} {len(self.layers_fused(s.fusion))}"
            for s in self.per_pass.values()
            if s.fusion is not None
        )
        kept = sum(1 for info in self.layers.values() if info["mode"] == "none")
        not_fused = sorted(
            {
                layer
                for s in self.per_pass.values()
                for layer, d in s.decisions.items()
                if d.startswith("not fused")
            }
        )
        n = len(self.layers)
        return (
            f"kvq graph {self.graph_id}: {n} attention layer{'s' if n != 1 else ''} ({by_mode}"
            f"{kept} kept unquantized); fused {fused or 'nothing (no fusion pass ran)'}; layers a "
            f"fusion passed over (see why per layer): {len(not_fused)}; passes "
            f"{self.time_s * 1e3:.1f} ms" + ("" if self.source == "passes" else f" ({self.source})")
        )

    def format(self) -> str:
        """A readable per-layer table, then per-pass stats."""
        passes = [s.name for s in self.per_pass.values() if s.decisions and not s.writes_stamps]
        header = ["layer", "mode", "kernel", *passes]
        rows = []
        per_layer = self.per_layer
        for name, info in self.layers.items():
            cells = [name, str(info["mode"]), f"{info['kernel']}@{info['arch']}"]
            cells += [per_layer.get(name, {}).get(p, "-") for p in passes]
            rows.append(cells)
        widths = [
            max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
            for i, h in enumerate(header)
        ]

        def line(cells: list[str]) -> str:
            return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

        out = [
            self.summary(),
            "",
            line(header),
            line(["-" * w for w in widths]),
            *(line(r) for r in rows),
            "",
        ]
        out.append("pass                          matches   time ms")
        for s in self.per_pass.values():
            out.append(f"{s.name:<30}{s.matches:>7}{s.time_s * 1e3:>10.2f}")
        out.append(f"ops before: {self.ops_before}")
        out.append(f"ops after:  {self.ops_after}")
        return "\n".join(out)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> GraphReport:
        data = json.loads(text)
        data["per_pass"] = {k: PassStats(**v) for k, v in data["per_pass"].items()}
        return cls(**data)


_reports: deque[GraphReport] = deque(maxlen=64)
_graph_ids = itertools.count()


def next_graph_id() -> int:
    """A process-wide number for each compiled graph (reports and dump folders use it)."""
    return next(_graph_ids)


def record(report: GraphReport) -> None:
    _reports.append(report)


def last_report() -> GraphReport | None:
    """The report of the last graph compiled with the kvq passes in this process, else None."""
    return _reports[-1] if _reports else None


def recent_reports() -> tuple[GraphReport, ...]:
    """The reports of the last (up to 64) compiled graphs, oldest first."""
    return tuple(_reports)
