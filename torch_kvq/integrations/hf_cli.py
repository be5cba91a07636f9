"""``kvq inspect --hf-config PATH`` and ``kvq demo / dump / accuracy --hf FAMILY``: the ``kvq``
command on transformers models. ``extend(subparsers)`` adds the options to the existing
subcommands (``cli.build_parser`` calls it); transformers is imported only when one is used.
``dump`` and ``accuracy`` build the model through ``cli.model_from_args``, which calls ``tiny_lm``.

``inspect --hf-config``: a local ``config.json`` (or a checkpoint folder holding one; nothing is
downloaded), instantiated on the meta device (no memory, no weights), attached with a one-token
dry run, then the same per-layer plan as ``kvq inspect``. ``demo --hf``: a tiny random-weight
model of a family (``hf_tiny.py``) generating with the requested KV config, against its own
kv "auto" run fed the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the runners only: ``kvq <sub> --help`` stays fast
    import torch

    from torch_kvq.spec import KVCacheConfig


def extend(sub: Any) -> None:
    """Add ``--hf-config`` to ``kvq inspect`` and ``--hf`` to ``kvq demo`` (when present)."""
    from torch_kvq.integrations.hf_tiny import FAMILIES

    family = dict(metavar="FAMILY", choices=sorted(FAMILIES))
    for name, flag, kw, runner in (
        ("inspect", "--hf-config", dict(metavar="PATH"), _inspect),
        ("demo", "--hf", family, _demo),
        ("dump", "--hf", family, None),
        ("accuracy", "--hf", family, None),
    ):
        p = sub.choices.get(name)
        if p is None:
            continue
        what = "a transformers config.json (or a folder with one) instead of --preset"
        if name != "inspect":
            what = "a tiny random-weight transformers model of this family instead of --preset"
        p.add_argument(flag, default=None, help=what, **kw)
        if runner is None:  # the subcommand's own runner builds the model (cli.model_from_args)
            continue
        own = p.get_default("func")
        p.set_defaults(func=_either(flag.lstrip("-").replace("-", "_"), runner, own))


def _either(attr: str, hf_runner: Any, own: Any) -> Any:
    return lambda args: hf_runner(args) if getattr(args, attr) is not None else own(args)


def tiny_lm(
    family: str, kv: KVCacheConfig, seed: int, num_pages: int, overrides: dict[str, Any]
) -> Any:
    """A tiny random-weight bf16 transformers model of ``family`` attached as a ``KVQCausalLM``."""
    import torch

    from torch_kvq.integrations.hf_tiny import tiny_hf_config, tiny_hf_model
    from torch_kvq.integrations.transformers import KVQCausalLM

    kw = {k: v for k, v in overrides.items() if k in ("num_hidden_layers", "head_dim")}
    types = getattr(tiny_hf_config(family), "layer_types", None)
    if "num_hidden_layers" in kw and types is not None:  # the family's pattern, cut or repeated
        kw["layer_types"] = [types[i % len(types)] for i in range(kw["num_hidden_layers"])]
    hf = tiny_hf_model(family, torch.bfloat16, seed, **kw)
    return KVQCausalLM.from_hf(hf, kv, num_pages=num_pages)


def _kv(args: argparse.Namespace) -> KVCacheConfig:
    from torch_kvq.cli_args import kv_config_from_args

    return kv_config_from_args(args)


def load_config(path: str) -> Any:
    """A transformers config from a local config.json or a folder holding one."""
    from torch_kvq.cli_args import CommandError

    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise CommandError(f"--hf-config {path!r}: no such config.json (nothing is downloaded)")
    import transformers

    data = json.loads(file.read_text())
    if "model_type" not in data:
        raise CommandError(f"--hf-config {path!r}: the config has no model_type")
    return transformers.AutoConfig.for_model(**data)


def _meta_model(config: Any, layers: int | None) -> torch.nn.Module:
    import torch
    import transformers

    text = config.get_text_config(decoder=True)
    if layers is not None:
        text.num_hidden_layers = layers
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = list(text.layer_types)[:layers]
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # multimodal models that generate text
            model = transformers.AutoModelForImageTextToText.from_config(config)
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


def _inspect(args: argparse.Namespace) -> int:
    from torch_kvq.attention.kernels import capabilities as caps
    from torch_kvq.debug.plan import format_plan, layer_plan, unserved_error
    from torch_kvq.integrations.transformers import KVQCausalLM

    caps.check_arch(args.arch)
    kv = _kv(args)
    if args.kernel is not None:
        caps.capabilities(args.kernel, args.arch)
    hf = _meta_model(load_config(args.hf_config), args.layers)
    with _no_meta_autocast():
        lm = KVQCausalLM.from_hf(hf, kv, num_pages=1)
    rows = layer_plan(lm.kv_specs, args.kernel, args.arch)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print(
            f"kvq inspect: {type(hf).__name__} from {args.hf_config} ({lm.dtype}), "
            f"kv_cache_dtype={kv.kv_cache_dtype!r}, skip_layers={kv.skip_layers}, arch {args.arch}, "
            f"kernel {rows[0]['kernel']}"
        )
        print()
        print(format_plan(lm.kv_specs, rows))
        q = sum(s.is_quantized for s in lm.kv_specs)
        total = sum(s.cache_bytes_per_token for s in lm.kv_specs)
        print(f"\n{q} of {len(lm.kv_specs)} layers quantized; KV bytes per token: {total}")
    err = unserved_error(rows)
    if err is not None:
        raise err
    return 0


def _demo(args: argparse.Namespace) -> int:
    import torch

    from torch_kvq.integrations.hf_tiny import tiny_hf_model
    from torch_kvq.integrations.transformers import KVQCausalLM
    from torch_kvq.models import generate
    from torch_kvq.spec import KVCacheConfig, format_spec_table

    kv = _kv(args)
    lm = KVQCausalLM.from_hf(tiny_hf_model(args.hf, torch.bfloat16, args.seed), kv, num_pages=64)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 23, 12)]
    lm.configure_kv(KVCacheConfig(page_size=kv.page_size))
    ref = generate(lm, prompts, args.max_new_tokens)
    lm.configure_kv(kv)
    forward = None
    if args.compile != "off":
        from torch_kvq.passes import kvq_backend, make_kvq_backend

        backend = kvq_backend if args.compile == "kvq" else make_kvq_backend(inner="eager")
        forward = torch.compile(lm, backend=backend, fullgraph=True)
    out = generate(lm, prompts, args.max_new_tokens, forward=forward, force_tokens=ref.tokens)
    print(
        f"kvq demo: transformers {args.hf} (tiny, random weights), kv_cache_dtype="
        f"{kv.kv_cache_dtype!r}, skip_layers={kv.skip_layers}, compile {args.compile}"
    )
    print()
    print(format_spec_table(lm.kv_specs))
    if args.compile != "off":
        from torch_kvq.passes import last_report

        print()
        print(last_report().format())
    diff = max((a - b).abs().max().item() for a, b in zip(out.prefill_logits, ref.prefill_logits))
    diff = max(diff, (out.logits - ref.logits).abs().max().item())
    agree = sum(
        a == b for a, b in zip(out.logits.argmax(-1).flatten().tolist(), sum(ref.tokens, []))
    )
    print(
        f"\nmax |logit diff| vs kv 'auto': {diff:.4f} (max |logit| {ref.logits.abs().max():.2f}); "
        f"next-token agreement {agree}/{out.logits.shape[0] * out.logits.shape[1]}"
    )
    return 0
