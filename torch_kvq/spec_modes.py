"""The KV-cache modes: ``KVQuantMode``, what each stores, and the ``kv_cache_dtype`` strings.

Apart from ``spec`` so that the config and the resolved spec stay small; a layer's storage (code
dtype, codes per byte, cache slots, scale bytes) follows from its mode alone.
"""

from __future__ import annotations

import enum

import torch

FP8_DTYPE = torch.float8_e4m3fn  # what the FP8 modes store; their math: attention/quant.py


class KVQuantMode(enum.Enum):
    """How a layer's KV cache is stored. Values are strings and are never persisted as ints."""

    NONE = "none"  # cache in the model dtype (bf16 / fp16 / fp32)
    FP8_PER_TENSOR = "fp8_per_tensor"  # float8_e4m3fn, static per-tensor k and v scales
    INT8_PER_TOKEN_HEAD = "int8_per_token_head"  # int8, one fp32 scale per (token, kv head)
    FP8_PER_TOKEN_HEAD = "fp8_per_token_head"  # float8_e4m3fn, one fp32 scale per (token, kv head)
    # two rotated, asymmetric 4-bit codes per uint8 byte, one fp32 scale per (token, kv head) with
    # the zero point in its low mantissa bits (attention/quant.py); head size must be even
    INT4_PER_TOKEN_HEAD = "int4_per_token_head"
    # k as INT8_PER_TOKEN_HEAD, v as INT4_PER_TOKEN_HEAD in one uint8 cache [pages, 3, page, KH,
    # D / 2] (slots 0 / 1: k's int8 codes, channels 0..D/2-1 / D/2..D-1; slot 2: v's packed int4);
    # head size must be even
    K8V4_PER_TOKEN_HEAD = "k8v4_per_token_head"
    # transform-coded: k in a calibrated basis per (layer, kv head) at 6 / 4 / 3 bits by the
    # coordinates' weight, v's channel halves rotated at 5 / 4 bits, an fp16 scale and a zero-point
    # byte per group (attention/quant_tc.py); codes uint8 [pages, 2, page, KH, D / 2], the groups'
    # scales and v's fifth bits in ``kv_scale`` uint8 [pages, KH, tc4_aux_width(D), page]; needs
    # the layer's ``KBasis``; head size a multiple of 16
    TC4_PER_TOKEN_HEAD = "tc4_per_token_head"

    @property
    def is_quantized(self) -> bool:
        return self is not KVQuantMode.NONE

    @property
    def per_token_head(self) -> bool:
        """Scales computed per (token, kv head) when the token is written (``kv_scale``)."""
        return self in (
            KVQuantMode.INT8_PER_TOKEN_HEAD,
            KVQuantMode.FP8_PER_TOKEN_HEAD,
            KVQuantMode.INT4_PER_TOKEN_HEAD,
            KVQuantMode.K8V4_PER_TOKEN_HEAD,
        )

    @property
    def transform_coded(self) -> bool:
        """``TC4_PER_TOKEN_HEAD``: codes and group scales of its own layout (not ``per_token_head``'s
        fp32 ``kv_scale``), k through the layer's calibrated ``KBasis``."""
        return self is KVQuantMode.TC4_PER_TOKEN_HEAD

    @property
    def has_kv_scale(self) -> bool:
        """Codes that come with a ``kv_scale`` buffer: ``per_token_head`` or ``transform_coded``."""
        return self.per_token_head or self.transform_coded

    @property
    def codes_per_byte(self) -> int:
        """2 for the modes with 4-bit codes (``INT4_PER_TOKEN_HEAD``; ``K8V4_PER_TOKEN_HEAD``'s v;
        ``TC4_PER_TOKEN_HEAD``, D / 2 bytes a row for k and for v), 1 for every other mode; a
        cache's last dim is ``head_size // codes_per_byte``."""
        return 2 if self in _HALF_WIDTH else 1

    @property
    def cache_slots(self) -> int:
        """The cache's dim 1: 2 (k, v) for every mode but ``K8V4_PER_TOKEN_HEAD``, 3 (k's int8
        codes in two halves of ``head_size // 2`` bytes, v's packed int4 codes)."""
        return 3 if self is KVQuantMode.K8V4_PER_TOKEN_HEAD else 2

    @property
    def code_dtype(self) -> torch.dtype | None:
        """What a quantized mode stores (its cache dtype); None for ``NONE`` (the model dtype)."""
        return _CODE_DTYPES.get(self)

    @property
    def qmax(self) -> float | None:
        """The largest code magnitude a scale maps absmax to (127 / 448); None for ``NONE`` and
        ``K8V4_PER_TOKEN_HEAD`` (k's and v's differ: ``k_format`` / ``v_format``)."""
        return _QMAX.get(self)

    @property
    def per_token_head_format(self) -> str:
        """``"int8"`` / ``"fp8"`` / ``"int4"`` / ``"k8v4"``: the ``mode`` argument of the
        per-(token, head) math and ops (``attention/quant.py``; ``"k8v4"`` is the layer's: its k
        and v are quantized to ``k_format`` / ``v_format``); ValueError for a mode that is not
        per-(token, head)."""
        if not self.per_token_head:
            raise ValueError(f"mode {self.value!r} has no per-(token, head) format")
        return self.value.split("_", 1)[0]

    @property
    def k_format(self) -> str:
        """The per-(token, head) format k is quantized to: ``per_token_head_format``, or ``"int8"``
        for ``K8V4_PER_TOKEN_HEAD``; ValueError for a mode that is not per-(token, head)."""
        pair = _KV_FORMATS.get(self)
        return pair[0] if pair else self.per_token_head_format

    @property
    def v_format(self) -> str:
        """The per-(token, head) format v is quantized to: ``per_token_head_format``, or ``"int4"``
        for ``K8V4_PER_TOKEN_HEAD``; ValueError for a mode that is not per-(token, head)."""
        pair = _KV_FORMATS.get(self)
        return pair[1] if pair else self.per_token_head_format


_HALF_WIDTH = (
    KVQuantMode.INT4_PER_TOKEN_HEAD,
    KVQuantMode.K8V4_PER_TOKEN_HEAD,
    KVQuantMode.TC4_PER_TOKEN_HEAD,
)
_CODE_DTYPES = {
    KVQuantMode.FP8_PER_TENSOR: FP8_DTYPE,
    KVQuantMode.INT8_PER_TOKEN_HEAD: torch.int8,
    KVQuantMode.FP8_PER_TOKEN_HEAD: FP8_DTYPE,
    KVQuantMode.INT4_PER_TOKEN_HEAD: torch.uint8,
    KVQuantMode.K8V4_PER_TOKEN_HEAD: torch.uint8,  # k's int8 codes stored as their bit patterns
    KVQuantMode.TC4_PER_TOKEN_HEAD: torch.uint8,
}
# modes whose k and v have different formats (attention/quant.py's KV_FORMATS agrees; a test)
_KV_FORMATS = {KVQuantMode.K8V4_PER_TOKEN_HEAD: ("int8", "int4")}
_QMAX = {  # attention/quant.py's FP8_MAX / INT8_MAX (spec sits below it; a test checks they agree)
    KVQuantMode.FP8_PER_TENSOR: 448.0,
    KVQuantMode.INT8_PER_TOKEN_HEAD: 127.0,
    KVQuantMode.FP8_PER_TOKEN_HEAD: 448.0,
    KVQuantMode.INT4_PER_TOKEN_HEAD: 15.0,  # asymmetric: the codes 0..15 span [lo, hi]
}
SCALE_BYTES = 4  # one fp32 scale per (token, kv head), for k and for v, in per-(token, head) modes
TC4_HEAD_MULTIPLE = 16  # tc4's bit planes pack D / 16 bytes of one-bit codes


def tc4_aux_width(head_size: int) -> int:
    """Bytes of ``TC4_PER_TOKEN_HEAD``'s side record per (token, kv head): k's three fp16 group
    scales and zero points (9), v's two (6), one byte of padding (8 whole fp16 slots), v's first
    half's fifth bits (D / 16); the layout is ``attention/quant_tc.py``'s."""
    return 16 + head_size // TC4_HEAD_MULTIPLE


_DTYPE_ALIASES: dict[str, tuple[KVQuantMode, torch.dtype | None]] = {
    "auto": (KVQuantMode.NONE, None),
    "bfloat16": (KVQuantMode.NONE, torch.bfloat16),
    "bf16": (KVQuantMode.NONE, torch.bfloat16),
    "float16": (KVQuantMode.NONE, torch.float16),
    "fp16": (KVQuantMode.NONE, torch.float16),
    "half": (KVQuantMode.NONE, torch.float16),
    "float32": (KVQuantMode.NONE, torch.float32),
    "fp32": (KVQuantMode.NONE, torch.float32),
    "fp8": (KVQuantMode.FP8_PER_TENSOR, FP8_DTYPE),
    "fp8_e4m3": (KVQuantMode.FP8_PER_TENSOR, FP8_DTYPE),
    "int8_per_token_head": (KVQuantMode.INT8_PER_TOKEN_HEAD, torch.int8),
    "fp8_per_token_head": (KVQuantMode.FP8_PER_TOKEN_HEAD, FP8_DTYPE),
    "int4_per_token_head": (KVQuantMode.INT4_PER_TOKEN_HEAD, torch.uint8),
    "k8v4_per_token_head": (KVQuantMode.K8V4_PER_TOKEN_HEAD, torch.uint8),
    "tc4_per_token_head": (KVQuantMode.TC4_PER_TOKEN_HEAD, torch.uint8),
}


def parse_kv_cache_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype
) -> tuple[KVQuantMode, torch.dtype]:
    """Map a ``kv_cache_dtype`` string to (mode, storage dtype). ``auto`` means the model dtype."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype.lower() not in _DTYPE_ALIASES:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected one of {sorted(_DTYPE_ALIASES)}"
        )
    mode, dtype = _DTYPE_ALIASES[kv_cache_dtype.lower()]
    return mode, (dtype if dtype is not None else model_dtype)
