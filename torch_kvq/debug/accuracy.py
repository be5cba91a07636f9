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
from torch_kvq.attention.kernels.base import quantize_fp8
from torch_kvq.spec import KVCacheConfig, LayerKVSpec, resolve_layer_specs

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
        head = f"{'idx':>3}  {'type':7}  {'mode':14}  {'k_scale':>8}  {'v_scale':>8}  {'max_abs':>9}  {'rel':>9}  {'SQNR dB':>7}"
        rows = [head, "-" * len(head)]
        for la in self.layers:
            rows.append(
                f"{la.index:>3}  {la.attention_type:7}  {la.configured_mode:14}  {la.k_scale:>8.3g}  "
                f"{la.v_scale:>8.3g}  {la.max_abs:>9.3g}  {la.rel:>9.3g}  {la.sqnr_db:>7.1f}"
                + ("  <- under threshold" if la.flagged else "")
            )
        rows.append(
            f"threshold {self.threshold_db:.1f} dB ({self.scales} scales); suggested "
            f"skip_layers={self.suggested_skip_layers}"
        )
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
        """A PNG bar chart of SQNR by layer, the threshold as a line."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(5, 0.5 * len(self.layers) + 2), 3.5))
        colours = [
            "#e65100" if la.flagged else ("#2e7d32" if la.configured_mode != "none" else "#1565c0")
            for la in self.layers
        ]
        ax.bar([la.index for la in self.layers], [la.sqnr_db for la in self.layers], color=colours)
        ax.axhline(
            self.threshold_db,
            color="k",
            linestyle="--",
            linewidth=1,
            label=f"threshold {self.threshold_db:g} dB",
        )
        ax.set_xlabel("layer")
        ax.set_ylabel("FP8 attention SQNR (dB)")
        ax.set_title("FP8 KV error per layer (orange: under threshold)")
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def _capture(
    model: torch.nn.Module, run
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    captured: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def hook(mod: Attention, args: tuple[torch.Tensor, ...]) -> None:
        captured[mod.layer_name] = tuple(a.detach().clone() for a in args[:3])  # type: ignore[assignment]

    hooks = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, Attention)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return captured


def _attend(spec: LayerKVSpec, q, k, v, qo_lens: Sequence[int]) -> torch.Tensor:
    outs, start = [], 0
    for n in qo_lens:
        pos = torch.arange(n, device=q.device)
        sl = slice(start, start + n)
        outs.append(
            ref_attention(
                q[sl],
                k[sl],
                v[sl],
                pos,
                pos,
                spec.sm_scale,
                spec.sliding_window,
                spec.logits_soft_cap,
            )
        )
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
    seq_ids = [object() for _ in prompts]
    md = model.allocator.build_batch([(s, n) for s, n in zip(seq_ids, lens)], model.device)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=model.device)
    try:

        def run() -> None:
            with model.forward_context(md):
                model(ids, md.positions)

        captured = _capture(model, run)
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
        k8 = quantize_fp8(k, ks).float() * ks
        v8 = quantize_fp8(v, vs).float() * vs
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
