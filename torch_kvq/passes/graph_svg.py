"""SVG pictures of the attention part of a graph: one column per layer, nodes coloured by mode.

Colours: quantized layer, fused node (green); quantized layer, unfused node (orange); skipped /
unquantized layer (blue); an unstamped node feeding a kvq node (grey). Self-contained SVG text,
no Graphviz needed, so it renders in any browser and in CI.
"""

from __future__ import annotations

from html import escape

from torch import fx

from torch_kvq.passes.graph_utils import has_output_scale, op_label
from torch_kvq.passes.stamp import get_stamp, short_dtype

COLOURS = {
    "fused": ("#c8e6c9", "#2e7d32", "quantized layer, fused"),
    "unfused": ("#ffe0b2", "#e65100", "quantized layer, not fused"),
    "skipped": ("#bbdefb", "#1565c0", "skipped layer (model dtype)"),
    "other": ("#eeeeee", "#757575", "other node"),
}
BOX_W, BOX_H, COL_GAP, ROW_GAP, TOP = 210, 34, 40, 18, 70


def node_kind(node: fx.Node) -> str:
    """'fused' | 'unfused' | 'skipped' | 'other' for colouring."""
    stamp = get_stamp(node)
    if stamp is None:
        return "other"
    if not stamp.spec.is_quantized:
        return "skipped"
    return "fused" if stamp.fused else "unfused"


def _inputs_through_unstamped(node: fx.Node, stamped: set[fx.Node], depth: int = 4) -> set[fx.Node]:
    """Stamped nodes that feed ``node``, looking through up to ``depth`` unstamped nodes."""
    found: set[fx.Node] = set()
    frontier = list(node.all_input_nodes)
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n in stamped:
                found.add(n)
            else:
                nxt.extend(n.all_input_nodes)
        frontier = nxt
    return found


def graph_to_svg(graph: fx.Graph, title: str = "") -> str:
    """Render the stamped (kvq) nodes of ``graph`` grouped by layer as an SVG document."""
    columns: dict[str, list[fx.Node]] = {}
    order: dict[str, int] = {}
    for node in graph.nodes:
        stamp = get_stamp(node)
        if stamp is not None:
            columns.setdefault(stamp.layer, []).append(node)
            order[stamp.layer] = stamp.spec.index
    layers = sorted(columns, key=lambda name: order[name])
    stamped = {n for nodes in columns.values() for n in nodes}
    pos: dict[fx.Node, tuple[float, float]] = {}
    for col, layer in enumerate(layers):
        for row, node in enumerate(columns[layer]):
            pos[node] = (20 + col * (BOX_W + COL_GAP), TOP + 30 + row * (BOX_H + ROW_GAP))
    width = max(600, 40 + len(layers) * (BOX_W + COL_GAP))
    rows = max((len(v) for v in columns.values()), default=0)
    height = TOP + 60 + rows * (BOX_H + ROW_GAP) + 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="monospace" font-size="11">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" '
        'markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
        f'<text x="20" y="22" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    for i, (fill, stroke, text) in enumerate(v for k, v in COLOURS.items() if k != "other"):
        x = 20 + i * 230
        out.append(f'<rect x="{x}" y="34" width="14" height="14" fill="{fill}" stroke="{stroke}"/>')
        out.append(f'<text x="{x + 20}" y="45">{escape(text)}</text>')
    for col, layer in enumerate(layers):
        spec = get_stamp(columns[layer][0]).spec  # type: ignore[union-attr]
        x = 20 + col * (BOX_W + COL_GAP)
        mode = spec.mode.value if spec.is_quantized else f"kept {short_dtype(spec.model_dtype)}"
        head = f"L{spec.index} {spec.attention_type}: {mode}"
        out.append(f'<text x="{x}" y="{TOP + 18}" font-weight="bold">{escape(head)}</text>')
    for node in stamped:
        for src in _inputs_through_unstamped(node, stamped):
            (x1, y1), (x2, y2) = pos[src], pos[node]
            out.append(
                f'<line x1="{x1 + BOX_W / 2}" y1="{y1 + BOX_H}" x2="{x2 + BOX_W / 2}" y2="{y2}" '
                'stroke="#555" marker-end="url(#arrow)"/>'
            )
    for node, (x, y) in pos.items():
        kind = node_kind(node)
        fill, stroke, _ = COLOURS[kind]
        label = op_label(node).replace("kvq.", "")
        if label == "paged_attention_fp8" and has_output_scale(node):
            label += " (fp8 out)"
        out.append(
            f'<rect class="{kind}" x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="5" '
            f'fill="{fill}" stroke="{stroke}"><title>{escape(node.format_node() or node.name)}</title></rect>'
        )
        out.append(f'<text x="{x + 6}" y="{y + 14}">{escape(label[:30])}</text>')
        out.append(f'<text x="{x + 6}" y="{y + 27}" fill="#555">{escape(node.name[:30])}</text>')
    out.append("</svg>")
    return "\n".join(out)
