"""``kvq eval``: perplexity and greedy agreement of trained models under KV-cache configs, against
the same model with a model-dtype cache (``torch_kvq.evaluation.eval``), on Brown Corpus text.

Usage: ``kvq eval --model gemma3-270m --kv fp8 --kv fp8:skip=sliding_window``.

Flags:
  --model SOURCE       a shipped model name (smollm2-135m, gemma3-270m), a .gguf file or a local
                       HF checkpoint folder; repeatable (default: both shipped models)
  --kv [NAME=]SPEC     a KV config (``evaluation/kv_arg.py``: ``fp8``, ``fp8:skip=sliding_window``,
                       ``fp8:scales=PATH``, ``fp8:scale=2``, ``int4_per_token_head:channels=
                       calibrate``: K channel scales from 4 x 1024 tokens of the calibration
                       split, as kvq calibrate's); repeatable (default: ``fp8``). The
                       model-dtype cache (``auto``) row is always measured first, as the reference
  --kernel NAME        reference (default), flashinfer, flashinfer-triton, flashinfer-xqa;
                       repeatable; each kernel gets its own reference row
  --prefill P          FlashInfer's prefill: fa2 (default), fa3, fa3_fp8
  --compile off|kvq    kvq: torch.compile(lm, backend=make_kvq_backend(inner="eager")), so the
                       quantized layers run the kernels' fused paths (default off: eager, unfused)
  --dtype D            float32 | bfloat16 | float16 (default float32 on CPU, bfloat16 on CUDA)
  --device D           cpu | cuda (default: cuda for FlashInfer kernels, else cpu)
  --window N --windows N --decode-tokens N --prompts N --prompt-tokens N --new-tokens N --seed N
                       the measurement (``EvalSettings``; defaults 1024, 4, 128, 4, 32, 32, 0)
  --page-size N        KV page size (default 16)
  --json PATH          write the rows, settings and corpus texts as JSON
  --plot PATH          write a PNG of the deltas (matplotlib)
Progress goes to stderr. Bad input: ``kvq eval: error: ...``, exit code 2 (``torch_kvq.cli.main``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torch_kvq.cli.args import SUBCOMMANDS, check_out_paths

KERNELS = ("reference", "flashinfer", "flashinfer-triton", "flashinfer-xqa")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MODELS = ("smollm2-135m", "gemma3-270m")
# A copy of torch_kvq.evaluation.eval.EvalSettings' defaults, so that building the parser imports
# no torch (tests/cli/test_cli.py checks they match).
SETTINGS = {
    "window": 1024,
    "windows": 4,
    "decode_tokens": 128,
    "prompts": 4,
    "prompt_tokens": 32,
    "new_tokens": 32,
    "seed": 0,
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "eval",
        help=SUBCOMMANDS["eval"][1],
        description="Perplexity (prefill and decode) and greedy agreement of trained models "
        "under KV-cache configs, against the model-dtype cache, on Brown Corpus text.",
    )
    p.add_argument(
        "--model", action="append", metavar="SOURCE", help="shipped name, .gguf or folder"
    )
    p.add_argument("--kv", action="append", metavar="[NAME=]SPEC", help="KV config, repeatable")
    p.add_argument("--kernel", action="append", choices=KERNELS, help="repeatable")
    p.add_argument("--prefill", choices=("fa2", "fa3", "fa3_fp8"), default="fa2")
    p.add_argument("--compile", choices=("off", "kvq"), default="off")
    p.add_argument("--dtype", choices=DTYPES, default=None)
    p.add_argument("--device", default=None)
    for name, value in SETTINGS.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=int, default=value, help=f"default {value}")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    p.set_defaults(func=run)


def make_kernel(name: str, prefill: str):  # -> AttentionKernel
    """The kernel a ``--kernel`` name means (FlashInfer imported only for those)."""
    if name == "reference":
        from torch_kvq.attention.kernels.reference import ReferenceKernel

        return ReferenceKernel()
    from torch_kvq.attention.kernels.flashinfer import FlashInferKernel

    decode = {"flashinfer": "tensor_cores", "flashinfer-triton": "triton", "flashinfer-xqa": "xqa"}
    return FlashInferKernel(fp8_decode=decode[name], prefill=prefill)


def check_configs(lm: Any, source: object, texts: list[str], configs: list, kernels: dict) -> None:
    """Every ``--kv`` config resolved on the model and checked against every kernel before the
    first run: a bad one stops the command before the runs ahead of it, not after them."""
    from torch_kvq.attention.kernels.base import KernelUnsupportedError

    for text, cfg in zip(texts, configs):
        try:
            specs = lm.resolve_kv_specs(cfg)
            for kernel in kernels.values():
                for spec in specs:
                    kernel.check_supported(spec)
        except (ValueError, KernelUnsupportedError) as e:
            raise ValueError(f"--kv {text!r} on {source}: {e}") from e


def calibration_settings():  # -> EvalSettings
    """``kvq calibrate``'s default sample: 4 windows of 1024 tokens of the calibration split."""
    from torch_kvq.evaluation.eval import EvalSettings

    return EvalSettings(decode_tokens=0, prompts=1, prompt_tokens=1)


def with_channels(lm: Any, tok: Any, kv: Any, cfg: Any, bar: Any, memo: dict) -> Any:
    """``cfg`` with the K channel scales ``kv``'s ``channels=`` names (read from its file, or
    calibrated on ``calibration_settings``' sample) and the K bases its ``basis=`` names (a file,
    or calibrated likewise); calibrations are kept in ``memo`` (one per model and kind); ``cfg`` itself without
    either option."""
    from torch_kvq.evaluation.kv_arg import CALIBRATE

    try:
        if kv.channels == CALIBRATE:
            from torch_kvq.evaluation.calibrate import k_channel_scales

            table = _calibrated(lm, tok, bar, memo, "K channel scales", k_channel_scales)
            cfg = lm.with_k_channels(cfg, table)
        elif kv.channels is not None:
            from torch_kvq.integrations.hf_scales import checkpoint_k_channel_scales

            table = checkpoint_k_channel_scales(kv.channels, list(lm.layer_paths.values()))
            cfg = lm.with_k_channels(cfg, table)
        if kv.basis == CALIBRATE:
            from torch_kvq.evaluation.calibrate import k_bases

            cfg = lm.with_k_bases(cfg, _calibrated(lm, tok, bar, memo, "K bases", k_bases))
        elif kv.basis is not None:
            from torch_kvq.integrations.hf_scales import checkpoint_k_bases

            table = checkpoint_k_bases(kv.basis, list(lm.layer_paths.values()))
            cfg = lm.with_k_bases(cfg, table)
        return cfg
    except ValueError as e:
        raise ValueError(f"--kv {kv.spec!r}: {e}") from None


def _calibrated(lm: Any, tok: Any, bar: Any, memo: dict, what: str, fn: Any) -> Any:
    """``fn(lm, windows)`` on the calibration sample, once per ``what`` (kept in ``memo``)."""
    if what not in memo:
        from torch_kvq.evaluation import corpus
        from torch_kvq.evaluation.eval import eval_data

        bar.update(status=f"calibrating {what}")
        data = eval_data(tok, calibration_settings(), corpus.split("calibration"))
        memo[what] = fn(lm, data.windows)
    return memo[what]


def run(args: argparse.Namespace) -> int:
    import torch

    from torch_kvq.evaluation import corpus
    from torch_kvq.evaluation.eval import EvalSettings, eval_data, evaluate
    from torch_kvq.evaluation.eval_report import format_table, plot, to_json
    from torch_kvq.evaluation.kv_arg import CALIBRATE, parse_kv
    from torch_kvq.integrations.trained import load_trained
    from torch_kvq.progress import Progress
    from torch_kvq.spec import KVCacheConfig

    check_out_paths(args.json, args.plot)
    kernels = args.kernel or ["reference"]
    kvs = [parse_kv(t) for t in (args.kv or ["fp8"])]
    calibrate = any(CALIBRATE in (kv.channels, kv.basis) for kv in kvs)
    settings = EvalSettings(**{name: getattr(args, name) for name in SETTINGS})
    gpu = any(k != "reference" for k in kernels)
    device = args.device or ("cuda" if gpu else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    models = args.model or list(DEFAULT_MODELS)
    texts = corpus.split("eval")
    rows, data = [], {}
    total = len(models) * len(kernels) * (len(kvs) + 1)
    with Progress("kvq eval", total, unit="runs") as bar:
        for source in models:
            bar.update(status=f"loading {source}")
            lm, tok = load_trained(
                source,
                KVCacheConfig(page_size=args.page_size),
                dtype=dtype,
                device=device,
                num_pages=max(
                    settings.pages_needed(args.page_size),
                    calibration_settings().pages_needed(args.page_size) if calibrate else 0,
                ),
                kernel=make_kernel(kernels[0], args.prefill),
            )
            data[str(source)] = eval_data(tok, settings, texts)
            paths = list(lm.layer_paths.values())
            memo: dict = {}  # this model's calibrated K channel scales and K bases
            configs = [
                (
                    kv.name,
                    kv.spec,
                    with_channels(
                        lm,
                        tok,
                        kv,
                        kv.config(args.page_size, paths, str(source)),
                        bar,
                        memo,
                    ),
                )
                for kv in kvs
            ]
            served = {name: make_kernel(name, args.prefill) for name in kernels}
            check_configs(lm, source, [kv.spec for kv in kvs], [c for _, _, c in configs], served)
            for name in kernels:
                lm.kernel = served[name]
                rows += evaluate(
                    lm,
                    tok,
                    configs,
                    data[str(source)],
                    settings,
                    model=str(source),
                    kernel=name,
                    compile=args.compile == "kvq",
                    bar=bar,
                )
            lm.detach()
            del lm
    print(f"kvq eval: {', '.join(map(str, models))} on {device} ({str(dtype)[6:]})\n")
    print(format_table(rows, settings))
    if args.json is not None:
        args.json.write_text(to_json(rows, settings, data) + "\n")
        print(f"json: {args.json}")
    if args.plot is not None:
        plot(rows, str(args.plot))
        print(f"plot: {args.plot}")
    return 0
