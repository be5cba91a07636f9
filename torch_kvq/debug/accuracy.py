"""Per-layer accuracy of the FP8 KV path against the model-dtype reference.

Each layer is measured in isolation: its real q / k / v from a sample batch are captured once,
then attention is computed twice by the reference math, with k / v as they are and with k / v
quantized to FP8 with the layer's scales. Errors therefore do not accumulate across layers, and
every layer gets a number whether or not the config under study quantizes it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from torch_kvq.attention import Attention, calibrate_kv_scales, ref_attention
from torch_kvq.attention.calibration import layer_kv_scales
from torch_kvq.attention.quant import dequantize_fp8, quantize_fp8
from torch_kvq.spec import KVCacheConfig, LayerKVSpec
from torch_kvq.spec_resolve import resolve_layer_specs

DEFAULT_THRESHOLD_DB = 30.0


@dataclass(frozen=True)
class LayerAccuracy:
    index: int
    name: str
    attention_type: str
    configured_mode: str  # what the config under study does with the layer
    k_scale: float
    v_scale: float
    max_abs: float
    rel: float  # ||fp8 - ref|| / ||ref||
    sqnr_db: float  # 10 log10(||ref||^2 / ||fp8 - ref||^2)
    flagged: bool


@dataclass(frozen=True)
class AccuracyReport:
    layers: tuple[LayerAccuracy, ...]
    threshold_db: float
    scales: str  # "config" | "calibrated"

    @property
    def suggested_skip_layers(self) -> tuple[int, ...]:
        """Indices of layers whose FP8 SQNR is under the threshold."""
        return tuple(la.index for la in self.layers if la.flagged)

    def format(self) -> str:
        """The table, then what it suggests. Every layer is measured with FP8 k/v, also those the
        config keeps unquantized: their error columns are what quantizing them would cost."""
        width = max([len("layer")] + [len(la.name) for la in self.layers])
        head = (
            f"{'idx':>3}  {'layer':{width}}  {'type':7}  {'your config':14}  {'k_scale':>8}  "
            f"{'v_scale':>8}  {'max_abs':>9}  {'rel':>9}  {'SQNR dB':>7}"
        )
        error_cols = len(f"{'max_abs':>9}  {'rel':>9}  {'SQNR dB':>7}")
        group = "FP8 k/v error vs bf16 k/v"
        rows = [(" " * (len(head) - error_cols) + f"{group:^{error_cols}}").rstrip()]
        rows += [head, "-" * len(head)]
        for la in self.layers:
            kept = la.configured_mode == "none"
            note = "; ".join(("if it were quantized",) * kept + ("under threshold",) * la.flagged)
            rows.append(
                f"{la.index:>3}  {la.name:{width}}  {la.attention_type:7}  "
                f"{'kept bf16' if kept else la.configured_mode:14}  {la.k_scale:>8.3g}  "
                f"{la.v_scale:>8.3g}  {la.max_abs:>9.3g}  {la.rel:>9.3g}  {la.sqnr_db:>7.1f}"
                + (f"  <- {note}" if note else "")
            )
        kept = [la.index for la in self.layers if la.configured_mode == "none"]
        below = [la for la in self.layers if la.flagged]
        add = [la.index for la in below if la.configured_mode != "none"]
        rows.append("")
        rows.append(
            f"threshold {self.threshold_db:.1f} dB ({self.scales} scales); layers below it: "
            + (", ".join(str(la.index) for la in below) if below else "none")
        )
        keeps = (
            f"your config keeps layer{'s' if len(kept) != 1 else ''} "
            f"{', '.join(map(str, kept))} in bf16"
            if kept
            else "your config quantizes every layer"
        )
        if add:
            rows.append(
                f"suggested skip_layers: also keep layer{'s' if len(add) != 1 else ''} "
                f"{', '.join(map(str, add))} unquantized (add to your rules; {keeps})"
            )
        else:
            rows.append(f"suggested skip_layers: nothing to add ({keeps})")
        return "\n".join(rows)

    def to_json(self) -> str:
        return json.dumps(
            {
                "threshold_db": self.threshold_db,
                "scales": self.scales,
                "suggested_skip_layers": list(self.suggested_skip_layers),
                "layers": [asdict(la) for la in self.layers],
            },
            indent=2,
        )

    def plot(self, path: str) -> None:
        """A PNG bar chart of SQNR by layer, the threshold as a line; the y axis spans the data."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        kinds = {  # colour, legend label; only the kinds present get a legend entry
            "under": ("#e65100", "under threshold"),
            "fp8": ("#2e7d32", "quantized by your config"),
            "kept": ("#1565c0", "kept bf16 (error if it were quantized)"),
        }

        def kind(la: LayerAccuracy) -> str:
            return "under" if la.flagged else ("kept" if la.configured_mode == "none" else "fp8")

        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(self.layers) + 4.5), 3.5))
        ax.bar(
            [la.index for la in self.layers],
            [la.sqnr_db for la in self.layers],
            color=[kinds[kind(la)][0] for la in self.layers],
        )
        ax.axhline(self.threshold_db, color="k", linestyle="--", linewidth=1)
        finite = [la.sqnr_db for la in self.layers if math.isfinite(la.sqnr_db)]
        values = [*finite, self.threshold_db]
        lo, hi = min(values), max(values)
        pad = max(1.0, 0.15 * (hi - lo))
        ax.set_ylim(max(0.0, lo - pad), hi + pad)  # bars start below: the axis shows the spread
        ax.set_xticks([la.index for la in self.layers])
        ax.set_xlabel("layer index")
        ax.set_ylabel("SQNR with FP8 k/v (dB)")
        ax.set_title(f"FP8 k/v accuracy per layer: SQNR, higher is better ({self.scales} scales)")
        present = [k for k in kinds if any(kind(la) == k for la in self.layers)]
        handles = [Patch(color=kinds[k][0], label=kinds[k][1]) for k in present]
        handles.append(
            Line2D([], [], color="k", linestyle="--", label=f"threshold {self.threshold_db:g} dB")
        )
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)


def _capture(model, md, ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each attention layer's q / k / v of one forward of ``ids`` on the batch ``md``."""
    captured: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def hook(mod: Attention, args: tuple[torch.Tensor, ...]) -> None:
        captured[mod.layer_name] = tuple(a.detach().clone() for a in args[:3])  # type: ignore[assignment]

    hooks = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, Attention)]
    try:
        with model.forward_context(md):
            model(ids, md.positions)
    finally:
        for h in hooks:
            h.remove()
    return captured


def _attend(spec: LayerKVSpec, q, k, v, qo_lens: Sequence[int]) -> torch.Tensor:
    outs, start = [], 0
    opts = (spec.sm_scale, spec.sliding_window, spec.logits_soft_cap)
    for n in qo_lens:
        pos = torch.arange(n, device=q.device)
        sl = slice(start, start + n)
        outs.append(ref_attention(q[sl], k[sl], v[sl], pos, pos, *opts))
        start += n
    return torch.cat(outs)


@torch.no_grad()
def layer_accuracy(
    model,
    prompts: Sequence[Sequence[int]],
    kv_config: KVCacheConfig,
    threshold_db: float = DEFAULT_THRESHOLD_DB,
    calibrate: bool = False,
) -> AccuracyReport:
    """Measure every attention layer of ``model`` (a ``PagedDecoder``) on one prefill of ``prompts``.

    ``kv_config`` is the config under study: it gives each layer's configured mode and, unless
    ``calibrate``, its k/v scales; with ``calibrate`` the scales are amax / 448 of the sample.
    """
    if not math.isfinite(threshold_db):
        raise ValueError(f"threshold_db must be a finite number of dB, got {threshold_db!r}")
    configured = resolve_layer_specs(kv_config, model.layer_infos(), model.dtype)
    as_fp8 = resolve_layer_specs(
        KVCacheConfig(
            "fp8",
            page_size=kv_config.page_size,
            kv_scales=kv_config.kv_scales,
            default_k_scale=kv_config.default_k_scale,
            default_v_scale=kv_config.default_v_scale,
        ),
        model.layer_infos(),
        model.dtype,
    )
    lens = [len(p) for p in prompts]
    if not lens:
        raise ValueError("prompts is empty; expected at least one prompt")
    if 0 in lens:  # the allocator would name the sequence by its key, an object()
        raise ValueError(f"prompts[{lens.index(0)}] is empty; expected at least one token id")
    seq_ids = [object() for _ in prompts]
    md = model.allocator.build_batch([(s, n) for s, n in zip(seq_ids, lens)], model.device)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=model.device)
    try:
        captured = _capture(model, md, ids)
    finally:
        for s in seq_ids:
            model.allocator.free(s)
    results = []
    for conf, spec in zip(configured, as_fp8):
        q, k, v = captured[spec.name]
        ks, vs = spec.k_scale, spec.v_scale
        if calibrate:
            ks, vs = layer_kv_scales(spec.name, float(k.abs().max()), float(v.abs().max()))
        ref = _attend(spec, q, k, v, lens)
        k8 = dequantize_fp8(quantize_fp8(k, ks), ks)
        v8 = dequantize_fp8(quantize_fp8(v, vs), vs)
        err = _attend(spec, q, k8, v8, lens) - ref
        sig, noise = float(ref.pow(2).sum()), float(err.pow(2).sum())
        sqnr = 10 * math.log10(sig / noise) if noise > 0 else float("inf")
        results.append(
            LayerAccuracy(
                index=spec.index,
                name=spec.name,
                attention_type=spec.attention_type,
                configured_mode=conf.mode.value,
                k_scale=ks,
                v_scale=vs,
                max_abs=float(err.abs().max()),
                rel=math.sqrt(noise / sig) if sig > 0 else float("inf"),
                sqnr_db=sqnr,
                flagged=sqnr < threshold_db,
            )
        )
    return AccuracyReport(tuple(results), threshold_db, "calibrated" if calibrate else "config")


__all__ = ["AccuracyReport", "LayerAccuracy", "calibrate_kv_scales", "layer_accuracy"]
