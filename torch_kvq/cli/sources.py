"""The model and KV config the shared options describe (``args.add_model_args``).

``model_from_args`` returns anything with the decoder API (``kv_specs``, ``attention_layers``,
``allocator``, ``forward_context``, ``config.vocab_size``, called as ``model(ids, positions)``):
a preset ``PagedDecoder``, or a ``KVQCausalLM`` around a transformers model: a trained one
(``--model``: ``integrations.trained``; for the plan alone, built on the meta device from its
config, a GGUF's header included), a tiny random-weight one of a family (``--hf``) or one built
from a local config.json on the meta device (``--hf-config``: no weights, so only the plan can be
read from it). transformers is imported only when one of those is used. Failures of foreign code
(transformers, a bad JSON file) become a ``CommandError`` naming the file: ``kvq <cmd>: error:
...``, exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch_kvq.cli.args import CommandError

if TYPE_CHECKING:  # torch is imported by the runners only: ``kvq <sub> --help`` stays fast
    import torch

    from torch_kvq.distributed import TensorParallel
    from torch_kvq.spec import KVCacheConfig


def kv_config_from_args(args: argparse.Namespace) -> KVCacheConfig:
    from torch_kvq.spec import KVCacheConfig

    layer_modes = getattr(args, "kv_map", None) or ()
    default_skip = () if layer_modes else ("sliding_window",)
    skip = () if args.no_skip else tuple(args.skip or default_skip)
    return KVCacheConfig(
        kv_cache_dtype=args.kv_cache_dtype,
        skip_layers=skip,
        page_size=args.page_size,
        layer_modes=layer_modes,
    )


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``--layers`` / ``--head-dim`` (``kvq inspect`` only) as config overrides, checked."""
    overrides: dict[str, Any] = {}
    if args.layers is not None:
        if args.layers < 1:
            raise CommandError(f"--layers must be a positive int, got {args.layers}")
        overrides["num_hidden_layers"] = args.layers
    head_dim = getattr(args, "head_dim", None)
    if head_dim is not None:
        if head_dim < 1:
            raise CommandError(f"--head-dim must be a positive int, got {head_dim}")
        overrides["head_dim"] = head_dim
    return overrides


def preset_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The preset config's overrides (``--layers`` on a Gemma 3 preset keeps its 2 sliding :
    1 global pattern)."""
    overrides = _overrides(args)
    if "num_hidden_layers" in overrides and args.preset.startswith("gemma3"):
        n = overrides["num_hidden_layers"]
        overrides["layer_types"] = [
            "full_attention" if i % 3 == 2 else "sliding_attention" for i in range(n)
        ]
    return overrides


def check_tp(args: argparse.Namespace, size: int) -> None:
    """Tensor parallelism over ``size`` ranks: a preset whose query and KV heads both divide."""
    if args.preset is None:
        raise CommandError(
            "--tp runs the presets; transformers models (--model, --hf) take tp= in "
            "KVQCausalLM.from_hf"
        )
    from torch_kvq.models import PRESETS

    config = PRESETS[args.preset][0](**preset_overrides(args))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % size or kv_heads % size:
        fits = [n for n in range(1, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise CommandError(
            f"--tp {size} does not divide the {heads} query heads and {kv_heads} KV heads of "
            f"preset {args.preset}; expected one of {fits}"
        )


def model_from_args(
    args: argparse.Namespace,
    kv_config: KVCacheConfig | None = None,
    num_pages: int = 64,
    tp: TensorParallel | None = None,
    *,
    weights: bool = True,
    dtype: torch.dtype | None = None,
) -> Any:
    """Build the model the shared options describe (ValueError on bad config). ``tp``: this
    rank's tensor-parallel shard (presets only). ``weights=False``: the caller reads the plan only
    (``kvq inspect``), so ``--hf-config``'s meta-device model will do. ``dtype``: a trained model's
    (default float32)."""
    kv = kv_config if kv_config is not None else kv_config_from_args(args)
    if tp is not None:
        check_tp(args, tp.size)
    bases = {"k_bases_from": args.k_bases} if getattr(args, "k_bases", None) else {}
    if bases and args.preset is not None:
        raise CommandError(
            f"--k-bases {args.k_bases!r} names transformers layers (model.layers.N.self_attn); "
            f"preset {args.preset!r} is one of our decoders: run --model SOURCE or --hf FAMILY"
        )
    if args.model is not None:
        if not weights:
            return _trained_plan_lm(args.model, kv, _overrides(args), bases)
        if _overrides(args):
            raise CommandError(
                f"--layers / --head-dim change the model; trained model {args.model!r} keeps its "
                "own (kvq inspect takes them: it reads the plan only)"
            )
        return trained_lm(args.model, kv, num_pages, dtype, bases)
    if args.hf_config is not None:
        if weights:
            raise CommandError(
                f"--hf-config {args.hf_config!r} builds the model on the meta device, without "
                "weights, which only kvq inspect can use; run --model SOURCE, --preset NAME or --hf "
                "FAMILY"
            )
        return hf_config_lm(args.hf_config, kv, _overrides(args), bases)
    if args.hf is not None:
        return tiny_lm(args.hf, kv, args.seed, num_pages, _overrides(args), bases)
    from torch_kvq.models import build_model

    overrides = preset_overrides(args)
    return build_model(args.preset, kv, seed=args.seed, num_pages=num_pages, tp=tp, **overrides)


def trained_lm(
    source: str,
    kv: KVCacheConfig,
    num_pages: int,
    dtype: torch.dtype | None = None,
    from_hf: dict[str, Any] | None = None,
) -> Any:
    """A trained model (``integrations.trained``) on the CPU in ``dtype`` (default float32),
    attached as a ``KVQCausalLM`` (``from_hf``: more of its keywords, e.g. ``k_bases_from``); its
    tokenizer is ``trained_tokenizer(source)``."""
    import torch

    from torch_kvq.integrations.trained import load_trained

    try:
        lm, _ = load_trained(
            source, kv, num_pages=num_pages, dtype=dtype or torch.float32, **(from_hf or {})
        )
    except ImportError as e:  # the models extra is missing: say what to install
        raise CommandError(f"--model {source}: {e}") from None
    return lm


def trained_for_text(args: argparse.Namespace, pages: int) -> tuple[Any, Any]:
    """``(KVQCausalLM, tokenizer)`` of ``--model`` with a model-dtype cache of ``pages`` pages, in
    ``--dtype`` on ``--device`` (``kvq calibrate``, ``kvq accuracy --model``)."""
    import torch

    from torch_kvq.integrations.trained import load_trained
    from torch_kvq.spec import KVCacheConfig

    return load_trained(
        args.model,
        KVCacheConfig(page_size=args.page_size),
        dtype=getattr(torch, args.dtype),
        device=args.device,
        num_pages=pages,
    )


def trained_tokenizer(source: str) -> Any:
    """The tokenizer of a trained model (from its converted folder: no second conversion)."""
    import transformers

    from torch_kvq.integrations.trained_cache import converted_folder

    return transformers.AutoTokenizer.from_pretrained(str(converted_folder(source)))


def _trained_plan_lm(
    source: str, kv: KVCacheConfig, overrides: dict[str, Any], from_hf: dict[str, Any]
) -> Any:
    """A trained model's ``KVQCausalLM`` on the meta device from its config alone (a GGUF's
    header: no conversion, no weights), for the plan."""
    from torch_kvq.integrations.trained import model_config

    try:
        config = model_config(source)
    except ImportError as e:
        raise CommandError(f"--model {source}: {e}") from None
    return _meta_lm(f"--model {source!r}", config, overrides, kv, from_hf)


def tiny_lm(
    family: str,
    kv: KVCacheConfig,
    seed: int,
    num_pages: int,
    overrides: dict[str, Any],
    from_hf: dict[str, Any] | None = None,
) -> Any:
    """A tiny random-weight bf16 transformers model of ``family`` attached as a ``KVQCausalLM``."""
    import torch

    from torch_kvq.integrations.hf_tiny import tiny_hf_config, tiny_hf_model
    from torch_kvq.integrations.transformers import KVQCausalLM

    kw = dict(overrides)
    types = getattr(tiny_hf_config(family), "layer_types", None)
    if "num_hidden_layers" in kw and types is not None:  # the family's pattern, cut or repeated
        kw["layer_types"] = [types[i % len(types)] for i in range(kw["num_hidden_layers"])]
    hf = tiny_hf_model(family, torch.bfloat16, seed, **kw)
    return KVQCausalLM.from_hf(hf, kv, num_pages=num_pages, **(from_hf or {}))


def hf_config_lm(
    path: str, kv: KVCacheConfig, overrides: dict[str, Any], from_hf: dict[str, Any] | None = None
) -> Any:
    """A ``KVQCausalLM`` around the transformers model of a local config, on the meta device (no
    memory, no weights), attached with a one-token dry run."""
    return _meta_lm(f"--hf-config {path!r}", load_config(path), overrides, kv, from_hf)


def _meta_lm(
    what: str,
    config: Any,
    overrides: dict[str, Any],
    kv: KVCacheConfig,
    from_hf: dict[str, Any] | None = None,
) -> Any:
    """The transformers model of ``config`` on the meta device, attached as a ``KVQCausalLM``
    with a one-token dry run."""
    from torch_kvq.integrations.transformers import KVQCausalLM

    hf = _meta_model(what, config, overrides)
    with _no_meta_autocast():
        try:
            return KVQCausalLM.from_hf(hf, kv, num_pages=1, **(from_hf or {}))
        except (ValueError, CommandError):
            raise  # ours: they name the layer and what is unsupported
        except Exception as e:  # noqa: BLE001 - transformers' forward on the meta device
            raise CommandError(
                f"{what}: the one-token dry run of {type(hf).__name__} on the meta "
                f"device failed ({type(e).__name__}: {e})"
            ) from None


def load_config(path: str) -> Any:
    """A transformers config from a local config.json or a folder holding one."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise CommandError(f"--hf-config {path!r}: no such config.json (nothing is downloaded)")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CommandError(f"--hf-config: {str(file)!r} is not a JSON config: {e}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise CommandError(f"--hf-config {str(file)!r}: the config has no model_type")
    import transformers

    if data["model_type"] not in transformers.CONFIG_MAPPING:
        raise CommandError(
            f"--hf-config {str(file)!r}: model_type {data['model_type']!r} is not one transformers "
            f"{transformers.__version__} knows"
        )
    try:
        return transformers.AutoConfig.for_model(**data)
    except Exception as e:  # noqa: BLE001 - transformers' own errors, reported without traceback
        raise CommandError(
            f"--hf-config {str(file)!r}: transformers cannot read it ({type(e).__name__}: {e})"
        ) from None


def _meta_model(what: str, config: Any, overrides: dict[str, Any]) -> torch.nn.Module:
    import torch
    import transformers

    if getattr(config, "is_encoder_decoder", False):
        raise CommandError(
            f"{what}: model_type {config.model_type!r} is an encoder-decoder model; "
            "encoder-decoder is not supported (torch-kvq attaches decoder-only causal language "
            "models)"
        )
    text = config.get_text_config(decoder=True)
    layers = overrides.get("num_hidden_layers")
    if layers is not None:
        text.num_hidden_layers = layers
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = list(text.layer_types)[:layers]
    if "head_dim" in overrides:
        text.head_dim = overrides["head_dim"]
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # multimodal models that generate text
            try:
                model = transformers.AutoModelForImageTextToText.from_config(config)
            except ValueError:
                raise CommandError(
                    f"{what}: model_type {config.model_type!r} has no causal "
                    "language model class in transformers (AutoModelForCausalLM, "
                    "AutoModelForImageTextToText); torch-kvq attaches decoder-only causal "
                    "language models"
                ) from None
        except Exception as e:  # noqa: BLE001 - transformers' own errors, without traceback
            raise CommandError(
                f"{what}: transformers cannot build model_type "
                f"{config.model_type!r} from it ({type(e).__name__}: {e})"
            ) from None
    return model.to(dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16).eval()


@contextlib.contextmanager
def _no_meta_autocast() -> Iterator[None]:
    """transformers 4.x's rotary forward enters ``torch.autocast(device_type="meta")``, which
    torch rejects ("unsupported scalarType"); 5.x skips autocast on meta. Same effect here."""
    import torch

    real = torch.autocast

    def autocast(device_type: str, *a: Any, **kw: Any) -> Any:
        return contextlib.nullcontext() if device_type == "meta" else real(device_type, *a, **kw)

    torch.autocast = autocast  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.autocast = real  # type: ignore[misc]
