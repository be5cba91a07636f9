"""``index.html`` of a ``kvq dump`` folder: each compiled graph (prefill / decode labelled), what
fused per layer, then its passes in the order they ran, each with its code, diff and picture
inline; then the other files (plan, depyf)."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STYLE = """body{font-family:sans-serif;max-width:1400px;margin:1em auto;padding:0 1em}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px;
text-align:left}th{background:#f3f3f3}.fused{background:#c8e6c9}.kept{background:#bbdefb}
.notfused{background:#ffe0b2}details{margin:.4em 0}summary{cursor:pointer}
.svg{overflow-x:auto;border:1px solid #ddd}code{background:#f3f3f3}"""

INTRO = (
    "<p>The model was compiled with <code>kvq_backend</code> and called twice: a prefill call "
    "(a mixed batch of prompts) and a decode call. Each call compiled its own graph. For each "
    "graph: the summary, what each pass decided per layer, then the passes <b>in the order they "
    "ran</b>, each with the graph code before and after it, the diff, and a picture of the "
    "attention nodes after it (one column per layer; green: quantized layer, fused; orange: "
    "quantized layer, not yet fused; blue: layer kept in the model dtype). Hover a box for its "
    "FX node.</p>"
)
DEPYF_NOTE = (
    "depyf's dumps of the <b>prefill</b> compile: the Python code Dynamo runs "
    "(<code>full_code_for_forward</code>), the bytecode it transformed, and the Dynamo / AOT / "
    "post-grad / Inductor graphs (<code>__compiled_fn_*</code>). depyf watches the first "
    "compile only (its decompiler loops on the recompiled decode frame), and its warning about "
    "running the code several times is silenced: the decode graph is in <code>passes/</code>."
)


def write_index(out: Path, phases: Mapping[str, str] | None = None, title: str = "") -> Path:
    """Write ``out/index.html``. ``phases``: graph folder name -> what compiled it (``"prefill"``,
    ``"decode"``); ``title``: a line saying which model and config ran."""
    phases = phases or {}
    parts = [
        f"<!doctype html><meta charset=utf-8><title>kvq dump</title><style>{STYLE}</style>",
        "<h1>kvq dump</h1>",
    ]
    if title:
        parts.append(f"<p><b>{html.escape(title)}</b></p>")
    parts.append(INTRO)
    graphs = sorted(p for p in (out / "passes").glob("graph_*") if p.is_dir())
    if graphs:
        parts.append("<ul>")
        for g in graphs:
            phase = phases.get(g.name, "")
            label = f"{g.name}: {phase} graph" if phase else g.name
            parts.append(f'<li><a href="#{g.name}">{html.escape(label)}</a></li>')
        parts.append("</ul>")
    for g in graphs:
        parts += _graph_section(out, g, phases.get(g.name, ""))
    parts += _other_files(
        out, exclude={out / "index.html", *(p for g in graphs for p in g.rglob("*"))}
    )
    index = out / "index.html"
    index.write_text("\n".join(parts) + "\n")
    return index


def _link(out: Path, path: Path, text: str | None = None) -> str:
    rel = html.escape(path.relative_to(out).as_posix())
    return f'<a href="{rel}">{html.escape(text or path.name)}</a>'


def _graph_section(out: Path, folder: Path, phase: str) -> list[str]:
    head = f"{folder.name}: {phase} graph" if phase else folder.name
    parts = [f'<h2 id="{folder.name}">{html.escape(head)}</h2>']
    report_json = folder / "report.json"
    rep: dict[str, Any] = json.loads(report_json.read_text()) if report_json.exists() else {}
    per_pass: dict[str, dict[str, Any]] = rep.get("per_pass", {})
    if rep:
        from torch_kvq.passes.report import GraphReport

        summary = GraphReport.from_json(report_json.read_text()).summary()
        parts.append(f"<p>{html.escape(summary)} ({_link(out, folder / 'report.txt')})</p>")
        parts += _decision_table(rep)
    parts.append("<h3>The passes, in the order they ran</h3><ol>")
    names = list(per_pass) or sorted({p.name.split(".")[0] for p in folder.glob("*.after.py")})
    last = len(names) - 1
    for i, name in enumerate(names):
        stats = per_pass.get(name, {})
        files = [folder / f"{name}{s}" for s in (".before.py", ".after.py", ".diff")]
        links = ", ".join(_link(out, f) for f in files if f.exists())
        what = f"{stats.get('matches', '?')} matches, {stats.get('time_s', 0.0) * 1e3:.2f} ms"
        parts.append(f"<li><b>{html.escape(name)}</b>{_about(name)}: {what}; {links}")
        svg = folder / f"{name}.after.svg"
        if svg.exists():
            is_open = " open" if i in (0, last) else ""  # before any fusion, and the result
            parts.append(
                f"<details{is_open}><summary>picture after {html.escape(name)} "
                f"({_link(out, svg, 'open alone')})</summary><div class=svg>"
                f"{_svg_body(svg)}</div></details>"
            )
        parts.append("</li>")
    parts.append("</ol>")
    return parts


def _about(pass_name: str) -> str:
    """`` (what the pass does)``: the first line of its class's docstring, for the known passes."""
    from torch_kvq.passes.manager import PASSES

    cls = PASSES.get(pass_name)
    doc = (cls.__doc__ or "").strip().splitlines() if cls is not None else []
    return f" ({html.escape(doc[0].split(' (see')[0].rstrip('.'))})" if doc else ""


def _decision_table(rep: dict[str, Any]) -> list[str]:
    """One row per layer: mode, kernel, then each pass's decision (the stamping pass left out)."""
    per_pass = rep.get("per_pass", {})
    shown = [n for n, s in per_pass.items() if s.get("decisions") and not s.get("writes_stamps")]
    parts = ["<table><tr><th>layer</th><th>mode</th><th>kernel</th>"]
    parts += [f"<th>{html.escape(n)}</th>" for n in shown]
    parts.append("</tr>")
    for layer, info in rep.get("layers", {}).items():
        row = [layer, str(info.get("mode")), f"{info.get('kernel')}@{info.get('arch')}"]
        cells = "".join(f"<td>{html.escape(c)}</td>" for c in row)
        for n in shown:
            d = per_pass[n]["decisions"].get(layer, "-")
            starts = (("fused", "fused"), ("kept", "kept"), ("not fused", "notfused"))
            cls = next((c for prefix, c in starts if d.startswith(prefix)), "")
            cells += f'<td class="{cls}">{html.escape(d)}</td>'
        parts.append(f"<tr>{cells}</tr>")
    parts.append("</table>")
    return parts


def _svg_body(svg: Path) -> str:
    """The SVG inline (its text is ours: ``passes/graph_svg.py``, escaped there)."""
    text = svg.read_text()
    return text[text.index("<svg") :] if "<svg" in text else html.escape(text)


def _other_files(out: Path, exclude: set[Path]) -> list[str]:
    groups: dict[str, list[Path]] = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p not in exclude):
        groups.setdefault(path.parent.relative_to(out).as_posix(), []).append(path)
    if not groups:
        return []
    parts = ["<h2>Other files</h2>"]
    for folder, files in groups.items():
        heading = "plan (kvq inspect)" if folder == "." else folder + "/"
        parts.append(f"<h3>{html.escape(heading)}</h3>")
        if folder == "depyf":
            parts.append(f"<p>{DEPYF_NOTE}</p>")
        parts.append("<ul>")
        parts += [f"<li>{_link(out, f)}</li>" for f in files[:200]]
        if len(files) > 200:
            parts.append(f"<li>... {len(files) - 200} more</li>")
        parts.append("</ul>")
    return parts
