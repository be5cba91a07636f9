"""What ``tp_worker.py modes`` records of a quantized cache: each k / v value's pre-quantization
value in code units and the codes that differ between two runs (rounding-boundary flips). Not a
test module; the rank's side of ``test_tp.py``'s per-layer mode checks.

Every cache is read per side in its own format (``spec.mode.k_format`` / ``v_format`` for the
per-(token, head) modes: k8v4's k is int8, its v int4): int8 and e4m3 codes as stored, int4's
packed nibbles unpacked (``code - zp`` times the scale is the rotated value), k8v4's k from its
two slots (``quant.k8v4_k_codes``), so every layer reads as codes [slots, 2, KH, D].
"""

from __future__ import annotations

import torch

from torch_kvq.attention.quant import k8v4_k_codes, split_scale
from torch_kvq.attention.rotation import rotate
from torch_kvq.spec_modes import KVQuantMode

E4M3_VALUES = torch.unique(
    torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().nan_to_num(0.0)
)  # every finite e4m3 value, sorted
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 15.0}  # the largest code (magnitude), per format


def side_formats(spec) -> tuple[str, str]:
    """(k's format, v's format) of a quantized layer: "int8" | "fp8" | "int4"."""
    if spec.mode.per_token_head:
        return spec.mode.k_format, spec.mode.v_format
    return "fp8", "fp8"  # per tensor


class QuantTrace:
    """Forward hooks (eager) on every attention layer of ``model``: per call, in execution order
    (the prefill's layers, then each decode step's), the layer's inputs q / k / v and its output,
    and for a quantized layer the pre-quantization values ``y`` (code units: what is rounded to the
    stored code, with the layer's own per-(token, head) or static scale; int4: ``rotate(x) /
    scale + zp`` at the row's chosen clip ratio) of every k / v value it writes, by cache slot."""

    def __init__(self, model) -> None:
        from torch_kvq.attention.context import get_forward_context

        self.calls: list[dict] = []
        slots_total = model.attention_layers[0].kv_cache.shape[0] * model.kv_specs[0].page_size
        self.y: dict[int, torch.Tensor] = {}  # layer -> [slots, 2, KH, D] (nan: not written)
        self.row: dict[int, torch.Tensor] = {}  # layer -> [slots]: the call that wrote the slot

        def hook(i, mod, args, out):
            q, k, v = args
            spec = mod.spec
            slots = get_forward_context().metadata_for(spec).slot_mapping.long()
            self.calls.append(dict(layer=i, q=q, k=k, v=v, out=out, slots=slots.clone()))
            if not spec.is_quantized:
                return
            if i not in self.y:
                self.y[i] = torch.full((slots_total, 2, *k.shape[1:]), float("nan"))
                self.row[i] = torch.full((slots_total,), -1, dtype=torch.long)
            for j, x, fmt in ((0, k, side_formats(spec)[0]), (1, v, side_formats(spec)[1])):
                if fmt == "int4":  # the codes are round(rotate(x) * (1 / scale) + zp)
                    s, zp = split_scale(mod._quantize_per_token_head(x, fmt)[1])
                    self.y[i][slots, j] = rotate(x) * torch.reciprocal(s)[..., None] + zp[..., None]
                    continue
                if spec.mode.per_token_head:
                    scale = mod._quantize_per_token_head(x, fmt)[1][..., None]
                else:
                    scale = spec.k_scale if j == 0 else spec.v_scale
                self.y[i][slots, j] = x.float() / scale
            self.row[i][slots] = len(self.calls) - 1

        for i, a in enumerate(model.attention_layers):
            a.register_forward_hook(lambda mod, args, out, i=i: hook(i, mod, args, out))


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D / 2] of two int4 codes each (the even channel low) -> [..., D] fp32."""
    return torch.stack((packed & 0xF, packed >> 4), -1).flatten(-2).float()


def slot_view(attn, heads: slice | None = None) -> tuple[torch.Tensor, ...]:
    """A layer's cache, kv heads ``heads`` only, as (codes [slots, 2, KH, D] fp32, scales [slots,
    2, KH] (the scale used: int4's with its zero-point bits cleared), zero points [slots, 2, KH]
    (0 but for int4 sides)); scales and zero points None for the per-tensor modes."""
    heads = heads or slice(None)
    c, mode = attn.kv_cache, attn.spec.mode
    if mode is KVQuantMode.K8V4_PER_TOKEN_HEAD:  # [n, 3, page, KH, D / 2] -> [n, 2, page, KH, D]
        c = torch.stack((k8v4_k_codes(c[:, :2]).float(), _unpack(c[:, 2])), 1)
    elif mode is KVQuantMode.INT4_PER_TOKEN_HEAD:
        c = _unpack(c)
    codes = c.float().transpose(1, 2).reshape(-1, 2, *c.shape[3:])[:, :, heads]
    s = attn.kv_scale
    if s is None:
        return codes, None, None
    s = s.permute(0, 3, 1, 2).reshape(-1, 2, s.shape[2])[:, :, heads]
    zps = torch.zeros_like(s)
    scales = s.clone()
    for j, fmt in enumerate(side_formats(attn.spec)):
        if fmt == "int4":
            scales[:, j], zps[:, j] = split_scale(s[:, j].contiguous())
    return codes, scales, zps


def code_flips(spec, a, b, ya, yb, row) -> list[dict]:
    """Every code that differs between two caches of one layer (a / b: ``slot_view``s; ya / yb:
    the pre-quantization values by slot, yb None where unknown; row: the writing call by slot):
    the two codes, whether they are adjacent representable values of the side's format, the
    rounding boundary between them (their midpoint), the y values and one step's size in real
    units (the dequantized values' difference; int4: in the rotated basis)."""
    (ca, sa, za), (cb, sb, zb) = a, b
    fmts = side_formats(spec)
    out = []
    for slot, j, h, d in (ca != cb).nonzero().tolist():
        x, z = ca[slot, j, h, d].item(), cb[slot, j, h, d].item()
        if fmts[j] == "fp8":
            ix, iz = (int((E4M3_VALUES == t).nonzero()) for t in (x, z))
            adjacent = abs(ix - iz) == 1
        else:
            adjacent = abs(x - z) == 1
        if sa is None:
            scale = spec.k_scale if j == 0 else spec.v_scale
            step = abs(x - z) * scale
        else:
            xa, xb = x - za[slot, j, h].item(), z - zb[slot, j, h].item()
            step = abs(xa * sa[slot, j, h].item() - xb * sb[slot, j, h].item())
        out.append({
            "layer": spec.name, "mode": spec.mode.value, "format": fmts[j], "row": int(row[slot]),
            "kv": "kv"[j], "head": h, "dim": d, "codes": [x, z], "adjacent": adjacent,
            "boundary": (x + z) / 2, "step": step, "qmax": QMAX[fmts[j]],
            "y": [ya[slot, j, h, d].item(), None if yb is None else yb[slot, j, h, d].item()],
        })  # fmt: skip
    return out
