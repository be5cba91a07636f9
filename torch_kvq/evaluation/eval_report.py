"""``EvalRow``s as a table, a JSON document and a plot (what ``kvq eval`` prints and writes)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from torch_kvq.evaluation.eval import EvalData, EvalRow, EvalSettings

COLUMNS = (
    ("model", "model", "{}"),
    ("KV config", "kv", "{}"),
    ("kernel", "kernel", "{}"),
    ("compile", "compile", "{}"),
    ("dtype", "dtype", "{}"),
    ("quantized", "quantized_layers", "{}"),
    ("ppl", "ppl", "{:.4f}"),
    ("delta %", "ppl_delta_pct", "{:+.2f}"),
    ("decode ppl", "decode_ppl", "{:.4f}"),
    ("delta %", "decode_delta_pct", "{:+.2f}"),
    ("agreement", "agreement", "{:.1%}"),
    ("prefix", "common_prefix", "{}"),
)


def _cell(r: EvalRow, attr: str, fmt: str) -> str:
    value = getattr(r, attr)
    if attr == "quantized_layers":
        return f"{r.quantized_layers}/{r.layers}"
    if attr == "common_prefix":
        return "/".join(map(str, value)) or "-"
    if isinstance(value, float) and value != value:  # NaN: the phase was not run
        return "-"
    return fmt.format(value)


def format_table(rows: Sequence[EvalRow], settings: EvalSettings) -> str:
    """The table, then what its columns mean."""
    body = [[_cell(r, a, f) for _, a, f in COLUMNS] for r in rows]
    head = [h for h, _, _ in COLUMNS]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line(["-" * w for w in widths]), *(line(b) for b in body)]
    out += [
        "",
        f"ppl: teacher-forced perplexity of {settings.windows} windows of {settings.window} "
        "tokens by prefill (prefill reads the quantized cache back); decode ppl: their last "
        f"{settings.decode_tokens} tokens fed one per decode step; delta: against the auto row "
        "(model-dtype cache) of the same model, kernel and compile; agreement: greedy tokens "
        f"equal to the auto row's ({settings.prompts} prompts x {settings.new_tokens} tokens); "
        "prefix: per prompt, tokens equal before the first difference.",
    ]
    return "\n".join(out)


def to_json(
    rows: Sequence[EvalRow],
    settings: EvalSettings,
    data: dict[str, EvalData],
    extra: dict[str, Any] | None = None,
) -> str:
    """Settings, which corpus texts each model read, and every row."""
    doc = {
        "settings": asdict(settings),
        "corpus": {
            m: {"windows": list(d.window_files), "prompts": list(d.prompt_files)}
            for m, d in data.items()
        },
        "rows": [asdict(r) for r in rows],
        **(extra or {}),
    }
    return json.dumps(doc, indent=2)


def plot(rows: Sequence[EvalRow], path: str) -> None:
    """A PNG: ppl delta and decode ppl delta (%) per model x config x kernel, the reference rows
    left out (their delta is 0 by definition)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.spec != "auto"]
    labels = [
        f"{r.model}\n{r.kv}\n{r.kernel}{' (kvq)' if r.compile == 'kvq' else ''}" for r in shown
    ]
    xs = range(len(shown))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(shown) + 2), 4))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [r.ppl_delta_pct for r in shown], width, label="ppl")
    ax.bar(
        [x + width / 2 for x in xs], [r.decode_delta_pct for r in shown], width, label="decode ppl"
    )
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("perplexity vs model-dtype cache (%)")
    ax.set_title("KV-cache configs on trained models (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
