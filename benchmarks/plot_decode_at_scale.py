"""Plot benchmarks/results/decode_at_scale.json: how decode throughput grows with context and batch.

Left: tokens/s against context at batch 32; right: tokens/s against batch at 16k (the last point
of each line is the largest batch that fits the GPU). Solid lines are measured (batch / median
step time: a few steps of a run can stall for tens of ms, which the mean in the tables keeps),
dashed lines the bandwidth bound (weights + KV read once per step at copy bandwidth); a missing
point did not fit in memory. Solid lines with stars: q/k/v and gate/up fused into one GEMM each
(``--fuse-projections``, the configs of the headline runs); dotted: earlier runs with separate
GEMMs. Each model's runs (date, commit) are in its titles.

    python benchmarks/plot_decode_at_scale.py [rows.json] [out.png]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
BOUND = {"bf16": "tab:blue", "fp8": "black", "int8_per_token_head": "tab:brown",
         "fp8_per_token_head": "tab:pink", "mixed": "tab:olive",
         "int8_per_token_head-all": "tab:gray", "fp8_per_token_head-all": "tab:cyan",
         "int4_per_token_head-all": "tab:green", "int4-recommended": "darkgreen",
         "int4_per_token_head-all+channels": "lime", "tc4_per_token_head-all": "tab:red"}  # fmt: skip
BOUND_NAME = {"bf16": "bf16", "fp8": "FP8", "int8_per_token_head": "int8 per (token, head)",
              "fp8_per_token_head": "FP8 per (token, head)", "mixed": "mode map",
              "int8_per_token_head-all": "int8 per (token, head), every layer",
              "fp8_per_token_head-all": "FP8 per (token, head), every layer",
              "int4_per_token_head-all": "int4 per (token, head), every layer",
              "int4-recommended": "int4-recommended",
              "int4_per_token_head-all+channels": "int4, every layer, K channel scales",
              "tc4_per_token_head-all": "tc4 (transform-coded 4-bit), every layer"}  # fmt: skip
LABELS = {
    ("bf16", "bf16"): ("all-bf16 KV", "tab:blue"),
    ("fp8", "tc-bf16"): ("FP8 KV, tensor cores, bf16 math (accurate, ~2e-3)", "tab:red"),
    ("fp8", "tc"): ("FP8 KV, tensor cores, fp16 math (accurate, ~2e-3)", "tab:orange"),
    ("fp8", "triton"): (
        "FP8 KV, torch_kvq Triton TMA kernel, fp16 math (accurate, ~2e-3)",
        "tab:purple",
    ),
    ("fp8", "xqa"): ("FP8 KV, XQA (FP8 math, ~4e-2)", "tab:green"),
    ("int8_per_token_head", "triton"): (
        "int8 per (token, head) KV, torch_kvq Triton TMA kernel",
        "tab:brown",
    ),
    ("fp8_per_token_head", "triton"): (
        "FP8 per (token, head) KV, torch_kvq Triton TMA kernel",
        "tab:pink",
    ),
    ("int8_per_token_head-all", "triton"): (
        "int8 per (token, head) KV on every layer, torch_kvq Triton TMA kernel",
        "tab:gray",
    ),
    ("fp8_per_token_head-all", "triton"): (
        "FP8 per (token, head) KV on every layer, torch_kvq Triton TMA kernel",
        "tab:cyan",
    ),
    ("mixed", "triton"): (
        "per-layer mode map (MIXED in bench_decode_at_scale.py), Triton TMA",
        "tab:olive",
    ),
    ("int4_per_token_head-all", "triton"): (
        "int4 per (token, head) KV on every layer, torch_kvq Triton TMA kernel",
        "tab:green",
    ),
    ("int4-recommended", "triton"): (
        "int4-recommended map (int4, 8 of 32 layers k8v4), torch_kvq Triton TMA kernel",
        "darkgreen",
    ),
    ("int4_per_token_head-all+channels", "triton"): (
        "int4 on every layer with K channel scales, torch_kvq Triton TMA kernel",
        "lime",
    ),
    ("tc4_per_token_head-all", "triton"): (
        "tc4 (transform-coded 4-bit) on every layer, torch_kvq Triton TMA kernel",
        "firebrick",
    ),
}


def tokens_per_s(row: dict) -> float:
    """batch / median step (the mean where a row has no median)."""
    med = row.get("step_median_ms")
    return row["batch"] * 1000.0 / med if med else row["tokens_per_s"]


def main() -> None:
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "results" / "decode_at_scale.json"
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else HERE / "results" / "decode_at_scale.png"
    all_rows = json.loads(src.read_text())
    rows = [r for r in all_rows if r.get("tokens_per_s")]
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 5.2 * len(models) + 1.4), squeeze=False)
    for m, (ax_ctx, ax_b) in zip(models, axes):
        bounds_drawn: set[tuple[int, str]] = set()
        tops: set[int] = set()  # the largest batches annotated (the FP8 kernels share one)
        for (kv, kernel), (label, color) in LABELS.items():
            ours = [r for r in rows if (r["model"], r["kv_config"], r["kernel"]) == (m, kv, kernel)]
            for fused in (True, False):  # fused: the headline configs; separate: earlier runs
                mine = [r for r in ours if bool(r.get("fused_projections")) == fused]
                by_ctx = sorted(
                    (r for r in mine if r["sweep"] == "ctx_sweep"), key=lambda r: r["ctx"]
                )
                by_b = sorted((r for r in mine if r["ctx"] == 16384), key=lambda r: r["batch"])
                by_b = list({r["batch"]: r for r in by_b}.values())
                name = label if fused else f"{label.split(' (')[0]}, separate q/k/v, gate/up GEMMs"
                style = (
                    dict(marker="*", markersize=11, lw=2)
                    if fused
                    else dict(marker="o", ls=":", lw=1, alpha=0.5)
                )
                for ax, pts, key in ((ax_ctx, by_ctx, "ctx"), (ax_b, by_b, "batch")):
                    if not pts:
                        continue
                    xs = [p[key] for p in pts]
                    ax.plot(xs, [tokens_per_s(p) for p in pts], color=color, label=name, **style)
                    if (
                        (id(ax), kv) not in bounds_drawn
                        and len(pts) > 1
                        and all(p.get("bound_tokens_per_s") for p in pts)
                    ):
                        bounds_drawn.add((id(ax), kv))
                        # one bound per KV config (the FP8 kernels share it); none in a CPU smoke run
                        bound = BOUND_NAME[kv]
                        ax.plot(xs, [p["bound_tokens_per_s"] for p in pts], "--", color=BOUND[kv],
                                label=f"bandwidth bound, {bound} KV")  # fmt: skip
                if fused and by_b and by_b[-1]["batch"] not in tops:
                    top = by_b[-1]
                    tops.add(top["batch"])
                    ax_b.annotate(f"max batch {top['batch']}", (top["batch"], tokens_per_s(top)),
                                  textcoords="offset points", xytext=(-60, 8), color="dimgray")  # fmt: skip
            missing = [r for r in all_rows if (r["model"], r["kv_config"], r["kernel"]) == (m, kv, kernel)
                       and r["sweep"] == "ctx_sweep" and not r.get("fits")]  # fmt: skip
            for r in missing:
                ax_ctx.annotate(f"{label.split(',')[0]}: {r['ctx'] // 1024}k does not fit",
                                (r["ctx"], 0), textcoords="offset points", xytext=(-150, 20),
                                color=color, fontsize=8)  # fmt: skip
        ax_ctx.set_xscale("log", base=2)
        ax_ctx.set_xticks([4096, 8192, 16384, 32768], ["4k", "8k", "16k", "32k"])
        ax_ctx.set_xlabel("context (tokens per sequence), batch 32")
        ax_b.set_xlabel("batch (sequences), context 16k")
        for ax in (ax_ctx, ax_b):
            ax.set_ylabel("decode tokens/s (median step)")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        runs = sorted({f"{r['date']}, commit {r['commit']}" for r in rows if r["model"] == m})
        ax_ctx.set_title(f"{m}: tokens/s vs context\n" + "\n".join(runs), fontsize=9)
        ax_b.set_title(f"{m}: tokens/s vs batch at 16k (lines end at full memory)", fontsize=10)
    fig.suptitle(
        f"Decode on {rows[0]['gpu']}, CUDA graphs, torch_kvq's decoders at real dimensions"
    )
    legend: dict[str, object] = {}  # one entry per label across the panels, under them
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lab, h)
    leg_h = 0.3 + 0.17 * -(-len(legend) // 2)  # inches: two columns of 8-point entries
    fig.set_size_inches(12, 5.2 * len(models) + leg_h)
    fig.tight_layout(rect=(0, leg_h / (5.2 * len(models) + leg_h), 1, 1))
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=2, fontsize=8)
    fig.savefig(dst, dpi=110)
    print(dst)


if __name__ == "__main__":
    main()
