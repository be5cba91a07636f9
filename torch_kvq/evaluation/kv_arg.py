"""``--kv NAME=SPEC``: one KV-cache configuration to evaluate, written on the command line.

``SPEC`` is ``DTYPE[:OPTION[:OPTION...]]``:

- ``DTYPE``: any ``KVCacheConfig.kv_cache_dtype`` string (``fp8``, ``auto``, ``bfloat16``, ...);
- ``skip=RULE[,RULE...]``: skip rules (an int index, ``sliding_window``, ``full_attention``, a
  layer-name glob or name), e.g. ``skip=sliding_window`` or ``skip=0,-1``;
- ``scales=PATH``: per-layer k/v scales from a safetensors file in the compressed-tensors layout
  (``P.k_scale`` / ``P.v_scale``; what ``kvq calibrate`` writes, read by ``kv_scales_from``);
- ``scale=F``: every layer's default k and v scale; ``k_scale=F`` / ``v_scale=F``: one of them;
- ``channels=PATH``: K channel scales of the ``int4_per_token_head`` layers (``spec_channels.KChannelScale``)
  from a safetensors file (``P.k_channel_scale`` / ``P.k_channel_mean``, what ``kvq calibrate``
  writes); ``channels=calibrate``: calibrated on the corpus's calibration split first (``kvq
  eval``). A config with no int4 layer refuses it;
- ``basis=PATH``: the K bases of the ``tc4_per_token_head`` layers (``spec_channels.KBasis``) from
  a safetensors file (``P.k_basis``, what ``kvq calibrate`` writes); ``basis=calibrate``:
  calibrated on the corpus's calibration split first (``kvq eval``); every such layer needs one.
  A config with no tc4 layer refuses it;
- ``map=RULE:MODE[,RULE:MODE...]``: a per-layer mode map (``parse_kv_map``; the last option: it
  takes the rest of ``SPEC``), e.g. ``auto:map=0:fp8,full_attention:int8_per_token_head``.

A ``DTYPE`` may instead be a named preset of ``torch_kvq.kv_presets`` (``int4-recommended``,
``tc4-recommended``), with no option but the tables its layers take (``channels=``; ``basis=``):
it is resolved per model when the model is known (``KVArg.config``'s ``model``).

``NAME=`` is optional (the row's label; default: ``SPEC`` itself). Examples: ``fp8``,
``fp8-sliding-bf16=fp8:skip=sliding_window``, ``cal=fp8:scales=/tmp/kv_scales.safetensors``.
No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

OPTIONS = ("skip", "scales", "scale", "k_scale", "v_scale", "channels", "basis", "map")
CALIBRATE = "calibrate"  # channels=calibrate, basis=calibrate


@dataclass(frozen=True)
class KVArg:
    """A parsed ``--kv``: the label, the text, and the ``KVCacheConfig`` fields it sets
    (``scales``: a file to read per model, once its layer paths are known; ``channels``: K channel
    scales, which ``config`` does not apply: they need the model's int4 layers, and calibration
    the model itself, so ``kvq eval`` applies them to ``config``'s result (``cli.eval.
    with_channels``))."""

    name: str
    spec: str
    kv_cache_dtype: str
    skip_layers: tuple[int | str, ...] = ()
    layer_modes: tuple[tuple[int | str, str], ...] = ()
    scales: Path | None = None
    default_k_scale: float = 1.0
    default_v_scale: float = 1.0
    preset: str | None = None  # a kv_presets name (then the fields above are unused)
    channels: Path | str | None = None  # K channel scales: a file, or CALIBRATE
    basis: Path | str | None = None  # tc4 layers' K bases: a file, or CALIBRATE

    def config(
        self, page_size: int, layer_paths: list[str] | None = None, model: str | None = None
    ):  # -> KVCacheConfig
        """The ``KVCacheConfig`` (``layer_paths``: the model's HF attention paths, which the
        scales file is keyed by; needed when ``scales=`` was given; ``model``: the model's name,
        which a preset's measured layers are keyed by)."""
        from torch_kvq.spec import KVCacheConfig

        if self.preset is not None:
            from torch_kvq.kv_presets import kv_preset

            try:
                return kv_preset(self.preset, model=model, page_size=page_size)
            except ValueError as e:
                raise ValueError(f"--kv {self.spec!r}: {e}") from None

        kv_scales: dict[str | int, tuple[float, float]] = {}
        if self.scales is not None:
            from torch_kvq.integrations.hf_scales import checkpoint_kv_scales

            if layer_paths is None:
                raise ValueError(f"--kv {self.spec!r}: scales= needs the model's layer paths")
            kv_scales = dict(checkpoint_kv_scales(self.scales, layer_paths))
        return KVCacheConfig(
            kv_cache_dtype=self.kv_cache_dtype,
            skip_layers=self.skip_layers,
            layer_modes=self.layer_modes,
            page_size=page_size,
            kv_scales=kv_scales,
            default_k_scale=self.default_k_scale,
            default_v_scale=self.default_v_scale,
        )


def _rule(text: str) -> int | str:
    try:
        return int(text)
    except ValueError:
        return text


def parse_kv_map(text: str) -> tuple[tuple[int | str, str], ...]:
    """A per-layer mode map (TensorRT-LLM's range syntax plus rule names and globs): comma-separated
    ``RULE:MODE`` entries, e.g. ``0-3:fp8,4-35:int8_per_token_head,sliding_window:auto``. A
    ``RULE`` is a layer index (negative from the end), a range ``A-B`` of indices (both ends
    included), ``sliding_window``, ``full_attention``, a layer-name glob or a layer name; a
    ``MODE`` any ``kv_cache_dtype`` string. Returns ``KVCacheConfig.layer_modes``; ValueError
    naming a malformed entry."""
    out: list[tuple[int | str, str]] = []
    for entry in text.split(","):
        rule, sep, mode = entry.strip().rpartition(":")
        if not sep or not rule.strip() or not mode.strip():
            raise ValueError(
                f"map entry {entry!r} is not RULE:MODE (e.g. '0-3:fp8' or 'sliding_window:auto')"
            )
        rule, mode = rule.strip(), mode.strip()
        lo, dash, hi = rule.partition("-")
        if dash and lo.isdigit() and hi.isdigit():
            if int(lo) > int(hi):
                raise ValueError(f"map range {rule!r} is empty; expected A-B with A <= B")
            out += [(i, mode) for i in range(int(lo), int(hi) + 1)]
        else:
            out.append((_rule(rule), mode))
    return tuple(out)


def _float(what: str, value: str, spec: str) -> float:
    try:
        f = float(value)
    except ValueError:
        raise ValueError(f"--kv {spec!r}: {what}={value!r} is not a number") from None
    if not f > 0 or f == float("inf"):
        raise ValueError(f"--kv {spec!r}: {what}={value!r} must be a positive finite number")
    return f


def _channels(value: str, spec: str) -> Path | str:
    return _table_source("channels", value, spec)


def _table_source(key: str, value: str, spec: str) -> Path | str:
    """``calibrate`` or an existing file for ``channels=`` / ``basis=``."""
    if value == CALIBRATE:
        return CALIBRATE
    path = Path(value).expanduser()
    if not path.exists():
        raise ValueError(
            f"--kv {spec!r}: {key} file {value!r} does not exist (expected a file kvq calibrate "
            f"wrote, or {key}={CALIBRATE})"
        )
    return path


def parse_kv(text: str) -> KVArg:
    """Parse ``[NAME=]DTYPE[:OPTION...]`` (module docstring); ValueError naming the bad part."""
    from torch_kvq.spec_modes import parse_kv_cache_dtype

    name, eq, spec = text.partition("=")
    if not eq or ":" in name:  # no NAME= (an '=' inside an option belongs to the option)
        name, spec = "", text
    if not spec or not spec.split(":")[0]:
        raise ValueError(f"--kv {text!r}: expected [NAME=]DTYPE[:OPTION...], e.g. 'fp8:skip=0'")
    head, _, layer_map = spec.partition(":map=")  # map= takes the rest (its entries hold ':')
    dtype, *opts = head.split(":")
    if layer_map:
        opts.append(f"map={layer_map}")
    from torch_kvq.kv_presets import PRESETS

    if dtype in PRESETS:
        preset = PRESETS[dtype]
        keys = [o.partition("=")[0] for o in opts]
        if any(k not in preset.tables for k in keys) or len(set(keys)) < len(keys):
            takes = " or ".join(f"one {t}=" for t in preset.tables)
            raise ValueError(
                f"--kv {text!r}: the preset {dtype!r} takes no option but {takes} (got "
                f"{':'.join(opts)!r}); write its map out with map= to change it"
            )
        tables = {k: _table_source(k, o.partition("=")[2], text) for k, o in zip(keys, opts)}
        return KVArg(name=name or spec, spec=spec, kv_cache_dtype=preset.kv_cache_dtype,
                     preset=dtype, **tables)  # type: ignore[arg-type]  # fmt: skip
    import torch

    try:
        parse_kv_cache_dtype(dtype, torch.float32)
    except ValueError as e:  # it lists the accepted dtypes
        raise ValueError(f"--kv {text!r}: {e}") from None
    kw: dict[str, object] = {}
    seen: set[str] = set()
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or key not in OPTIONS or not value:
            raise ValueError(
                f"--kv {text!r}: option {opt!r} unknown; expected KEY=VALUE with KEY one of "
                f"{', '.join(OPTIONS)}"
            )
        if (
            key in seen
            or (key == "scale" and seen & {"k_scale", "v_scale"})
            or (key in ("k_scale", "v_scale") and "scale" in seen)
        ):
            raise ValueError(f"--kv {text!r}: {key} given twice (scale= sets k_scale and v_scale)")
        seen.add(key)
        if key == "map":
            try:
                kw["layer_modes"] = parse_kv_map(value)
            except ValueError as e:
                raise ValueError(f"--kv {text!r}: {e}") from None
        elif key == "skip":
            kw["skip_layers"] = tuple(_rule(r) for r in value.split(",") if r)
        elif key == "scales":
            path = Path(value).expanduser()
            if not path.exists():
                raise ValueError(f"--kv {text!r}: scales file {value!r} does not exist")
            kw["scales"] = path
        elif key == "channels":
            kw["channels"] = _channels(value, text)
        elif key == "basis":
            kw["basis"] = _table_source("basis", value, text)
        elif key == "scale":
            kw["default_k_scale"] = kw["default_v_scale"] = _float(key, value, text)
        else:
            kw[f"default_{key}"] = _float(key, value, text)
    return KVArg(name=name or spec, spec=spec, kv_cache_dtype=dtype, **kw)  # type: ignore[arg-type]
