"""``kvq accuracy --model SOURCE``: per-layer KV sensitivity measured on a trained model
(``torch_kvq.evaluation.sensitivity``) and the skip rules / modes it suggests; ``accuracy.py``
adds the flags and calls ``run`` when the model source is a trained model.

Usage: ``kvq accuracy --model gemma3-270m``.

Flags (besides the shared model options):
  --mode M             a quantized kv_cache_dtype to measure per layer (default fp8); repeatable,
                       cheapest first: the suggestion gives each layer the first mode within the
                       threshold
  --threshold-pct X    a layer whose perplexity delta exceeds X % is kept in the model dtype
                       (default 0.1)
  --scales PATH        k/v scales (compressed-tensors safetensors, what ``kvq calibrate`` writes)
                       for the quantized layer; default: scale 1.0
  --window N --windows N
                       the eval slice: N windows of N tokens from the eval split (default 512, 2)
  --dtype D --device D float32 (default) | bfloat16 | float16; cpu (default) | cuda
  --page-size N        KV page size (default 16)
  --json PATH          write the report as JSON
Progress goes to stderr.
"""

from __future__ import annotations

import argparse

from torch_kvq.cli.args import check_out_paths


def run(args: argparse.Namespace) -> int:
    from torch_kvq.cli.sources import trained_for_text
    from torch_kvq.evaluation import corpus
    from torch_kvq.evaluation.eval import EvalSettings, eval_data
    from torch_kvq.evaluation.sensitivity import check_modes, layer_sensitivity
    from torch_kvq.integrations.hf_scales import checkpoint_kv_scales
    from torch_kvq.progress import Progress

    check_out_paths(args.json)
    settings = EvalSettings(
        window=args.window, windows=args.windows, decode_tokens=1, prompts=1, prompt_tokens=1
    )
    modes = args.mode or ["fp8"]
    check_modes(modes, args.threshold_pct)  # before the model loads
    with Progress("kvq accuracy", unit="layers") as bar:
        bar.update(status=f"loading {args.model}")
        lm, tok = trained_for_text(args, settings.pages_needed(args.page_size))
        bar.total = len(lm.kv_specs) * len(modes)
        data = eval_data(tok, settings, corpus.split("eval"))
        scales = None
        if args.scales is not None:
            scales = checkpoint_kv_scales(args.scales, list(lm.layer_paths.values()))
        report = layer_sensitivity(
            lm,
            data.windows,
            modes,
            model=args.model,
            threshold_pct=args.threshold_pct,
            page_size=args.page_size,
            kv_scales=scales,
            bar=bar,
        )
    print(
        f"kvq accuracy: {args.model} ({args.dtype}, {args.device}), {args.windows} windows of "
        f"{args.window} tokens ({', '.join(data.window_files)}), scales "
        f"{args.scales or '1.0 (uncalibrated)'}\n"
    )
    print(report.format())
    if args.json is not None:
        args.json.write_text(report.to_json() + "\n")
        print(f"json: {args.json}")
    return 0
