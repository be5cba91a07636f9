"""Per-layer KV-quantization sensitivity measured on a trained model, and the config it suggests.

For every attention layer and every mode asked for (any quantized ``kv_cache_dtype`` string the
config accepts, e.g. ``fp8``), that layer alone is quantized (every other layer keeps the
model-dtype cache) and two things are measured on a short slice of the eval text:

- the perplexity delta against the all-model-dtype run (teacher-forced prefill, ``eval.py``);
- the relative error of that layer's attention output, ``||o_q - o|| / ||o||`` over all tokens
  (the layers before it are unquantized, so its inputs are the reference's: the error is its own).

The suggestion: per layer, the first mode (in the order given, cheapest first) whose delta is at
most ``threshold_pct``; a layer no mode meets stays in the model dtype (a skip rule). Deltas of a
few hundredths of a percent are within the noise of a short slice: the threshold should sit well
above the spread the report shows for harmless layers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from torch_kvq.attention.layer import Attention
from torch_kvq.evaluation.eval import teacher_forced_ppl
from torch_kvq.progress import Progress
from torch_kvq.spec import KVCacheConfig
from torch_kvq.spec_modes import parse_kv_cache_dtype

DEFAULT_THRESHOLD_PCT = 0.1


@dataclass(frozen=True)
class LayerSensitivity:
    index: int
    name: str
    attention_type: str  # "sliding" | "global"
    mode: str  # the kv_cache_dtype string measured
    ppl: float
    delta_pct: float  # perplexity vs the all-model-dtype run, in %
    attn_rel_err: float  # ||o_q - o|| / ||o|| of this layer's attention output


@dataclass(frozen=True)
class SensitivityReport:
    model: str
    tokens: int  # tokens per window x windows
    reference_ppl: float
    threshold_pct: float
    modes: tuple[str, ...]
    layers: tuple[LayerSensitivity, ...]
    all_layers_delta_pct: tuple[float, ...]  # per mode: every layer quantized at once

    def choice(self) -> dict[int, str]:
        """Layer index -> the first mode within the threshold, or "auto" (kept)."""
        out: dict[int, str] = {}
        for mode in self.modes:
            for la in self.layers:
                if la.mode == mode and la.index not in out and la.delta_pct <= self.threshold_pct:
                    out[la.index] = mode
        n = max(la.index for la in self.layers) + 1
        return {i: out.get(i, "auto") for i in range(n)}

    def suggestion(self) -> str:
        """The suggested config in words, with the ``--kv`` / ``KVCacheConfig`` to write."""
        choice = self.choice()
        kept = [i for i, m in choice.items() if m == "auto"]
        sliding = sorted({la.index for la in self.layers if la.attention_type == "sliding"})
        if len(self.modes) == 1:
            mode = self.modes[0]
            if not kept:
                return (
                    f"every layer's {mode} delta is within {self.threshold_pct:g}%: quantize all "
                    f"(--kv {mode}; KVCacheConfig({mode!r}))"
                )
            rules = "sliding_window" if kept == sliding else ",".join(map(str, kept))
            return (
                f"layers {_ranges(kept)} cost more than {self.threshold_pct:g}% each in {mode}: "
                f"keep them in the model dtype (--kv {mode}:skip={rules}; "
                f"KVCacheConfig({mode!r}, skip_layers={_rules_py(rules)}))"
            )
        spans = _spans(choice)
        return (
            f"per layer, the first of {', '.join(self.modes)} within {self.threshold_pct:g}% "
            f"(auto: none is): {spans}"
        )

    def format(self) -> str:
        head = f"{'idx':>3}  {'layer':30}  {'type':7}  {'mode':8}  {'ppl':>9}  {'delta %':>8}  {'attn rel err':>12}"
        rows = [head, "-" * len(head)]
        for la in self.layers:
            flag = "  <- over threshold" if la.delta_pct > self.threshold_pct else ""
            rows.append(
                f"{la.index:>3}  {la.name:30}  {la.attention_type:7}  {la.mode:8}  {la.ppl:>9.4f}  "
                f"{la.delta_pct:>+8.3f}  {la.attn_rel_err:>12.3e}{flag}"
            )
        rows.append("")
        rows.append(
            f"reference (model-dtype cache): ppl {self.reference_ppl:.4f} over {self.tokens} "
            "tokens; each row quantizes that layer alone"
        )
        for mode, d in zip(self.modes, self.all_layers_delta_pct):
            total = sum(la.delta_pct for la in self.layers if la.mode == mode)
            rows.append(
                f"{mode} on every layer at once: {d:+.3f}% (sum of the rows: {total:+.3f}%)"
            )
        rows.append(f"suggestion: {self.suggestion()}")
        return "\n".join(rows)

    def to_json(self) -> str:
        doc = asdict(self)
        doc["suggestion"] = self.suggestion()
        doc["choice"] = self.choice()
        return json.dumps(doc, indent=2)


def _ranges(idx: Sequence[int]) -> str:
    out, start = [], None
    for i, x in enumerate(idx):
        if start is None:
            start = x
        if i + 1 == len(idx) or idx[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def _spans(choice: Mapping[int, str]) -> str:
    by: dict[str, list[int]] = {}
    for i, m in sorted(choice.items()):
        by.setdefault(m, []).append(i)
    return ",".join(f"{_ranges(ix)}:{m}" for m, ix in by.items())


def _rules_py(rules: str) -> str:
    parts = [p if not p.lstrip("-").isdigit() else p for p in rules.split(",")]
    return "(" + ", ".join(p if p.lstrip("-").isdigit() else repr(p) for p in parts) + ",)"


class _Outputs:
    """Forward hooks collecting each torch_kvq ``Attention`` layer's outputs (fp32, CPU)."""

    def __init__(self, lm: torch.nn.Module, only: int | None = None) -> None:
        self.out: dict[int, list[torch.Tensor]] = {}
        self.hooks = []
        for i, layer in enumerate(lm.attention_layers):
            if only is None or i == only:
                self.hooks.append(layer.register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def hook(mod: Attention, args: object, out: torch.Tensor) -> None:
            self.out.setdefault(i, []).append(out.detach().float().cpu())

        return hook

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).double().pow(2).sum()) for x, y in zip(a, b))
    den = sum(float(y.double().pow(2).sum()) for y in b)
    return math.sqrt(num / den) if den > 0 else float("inf")


def check_modes(modes: Sequence[str], threshold_pct: float) -> None:
    """ValueError unless every mode is a quantized ``kv_cache_dtype`` and the threshold finite."""
    if not math.isfinite(threshold_pct):
        raise ValueError(f"threshold_pct must be a finite number, got {threshold_pct!r}")
    if not modes:
        raise ValueError("no mode to measure; expected one or more, e.g. ('fp8',)")
    for m in modes:
        if not parse_kv_cache_dtype(m, torch.float32)[0].is_quantized:
            raise ValueError(f"mode {m!r} is not a quantized kv_cache_dtype (e.g. 'fp8')")


@torch.no_grad()
def layer_sensitivity(
    lm: torch.nn.Module,
    windows: Sequence[Sequence[int]],
    modes: Sequence[str] = ("fp8",),
    *,
    model: str = "",
    threshold_pct: float = DEFAULT_THRESHOLD_PCT,
    page_size: int = 16,
    kv_scales: Mapping[str | int, tuple[float, float]] | None = None,
    bar: Progress | None = None,
) -> SensitivityReport:
    """Quantize each layer alone in each mode and measure (module docstring). ``kv_scales``:
    per-layer scales for the quantized layer (default: the config's default 1.0)."""
    check_modes(modes, threshold_pct)
    scales = dict(kv_scales or {})
    lm.configure_kv(KVCacheConfig(page_size=page_size))
    hooks = _Outputs(lm)
    try:
        ref_ppl = teacher_forced_ppl(lm, windows)
    finally:
        hooks.close()
    ref = hooks.out
    n = len(lm.kv_specs)
    specs = lm.kv_specs
    layers, whole = [], []
    for mode in modes:
        for i in range(n):
            if bar is not None:
                bar.update(done=bar.done, status=f"{mode} on layer {i} alone")
            others = tuple(j for j in range(n) if j != i)
            lm.configure_kv(
                KVCacheConfig(mode, skip_layers=others, page_size=page_size, kv_scales=scales)
            )
            hooks = _Outputs(lm, only=i)
            try:
                ppl = teacher_forced_ppl(lm, windows)
            finally:
                hooks.close()
            layers.append(
                LayerSensitivity(
                    index=i,
                    name=specs[i].name,
                    attention_type=specs[i].attention_type,
                    mode=mode,
                    ppl=ppl,
                    delta_pct=100.0 * (ppl / ref_ppl - 1.0),
                    attn_rel_err=_rel(hooks.out[i], ref[i]),
                )
            )
            if bar is not None:
                bar.update(done=bar.done + 1)
        lm.configure_kv(KVCacheConfig(mode, page_size=page_size, kv_scales=scales))
        whole.append(100.0 * (teacher_forced_ppl(lm, windows) / ref_ppl - 1.0))
    lm.configure_kv(KVCacheConfig(page_size=page_size))
    return SensitivityReport(
        model=model,
        tokens=sum(len(w) for w in windows),
        reference_ppl=ref_ppl,
        threshold_pct=threshold_pct,
        modes=tuple(modes),
        layers=tuple(layers),
        all_layers_delta_pct=tuple(whole),
    )


__all__ = ["LayerSensitivity", "SensitivityReport", "layer_sensitivity"]
