"""A trained model's eager FP8 cost against the pool size, and compiled against eager perplexity.

1. ``--pages N ...``: the median eager decode step (the unfused form: quantize, write,
   dequantize the batch's pages, attend) of a trained model with every layer FP8, against the
   number of pages each layer holds: the dequantize op reads the batch's pages only, so the step
   should not grow with the pool. kv "auto" is the baseline.
2. ``--ppl``: teacher-forced perplexity of FP8 (scale 1.0, every layer) eager against compiled
   with the kvq passes (``make_kvq_backend(inner="eager")``: the fused reference-kernel path) on
   the eval split's first windows; both against kv "auto".

CPU by default (fp32 for perplexity, bf16 for the step, like ``kvq demo``); prints a table and
writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from torch_kvq.evaluation import corpus
from torch_kvq.evaluation.eval import EvalSettings, compiled, eval_data, teacher_forced_ppl
from torch_kvq.integrations.trained import load_trained
from torch_kvq.models import generate
from torch_kvq.spec import KVCacheConfig


def step_ms(lm: torch.nn.Module, prompts: list[list[int]], steps: int) -> float:
    times: list[float] = []
    generate(lm, prompts, steps + 1, on_step=lambda d, t, s: times.append(s))
    return 1000 * statistics.median(times[1:])  # decode steps only (step 1 is the prefill)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--pages", type=int, nargs="*", default=[80, 1024, 4096])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ppl", action="store_true", help="also compiled against eager perplexity")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    doc: dict = {
        "model": args.model,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }
    fp8 = KVCacheConfig(kv_cache_dtype="fp8")
    auto = KVCacheConfig()
    if args.pages:
        lm, tok = load_trained(args.model, auto, num_pages=max(args.pages), dtype=torch.bfloat16)
        prompts = [tok(corpus.text("ca01"))["input_ids"][:64]]
        rows = []
        for pages in args.pages:
            for name, cfg in (("auto", auto), ("fp8", fp8)):
                lm.num_pages = pages  # a plain attribute: configure_kv allocates that many
                lm.configure_kv(cfg)
                ms = step_ms(lm, prompts, args.steps)
                rows.append({"pages": pages, "kv": name, "median_step_ms": round(ms, 1)})
                print(f"pages {pages:5d}  kv {name:4s}  median eager decode step {ms:8.1f} ms")
        doc["eager_step"] = rows
        del lm
    if args.ppl:
        s = EvalSettings(window=args.window, windows=args.windows, decode_tokens=0, new_tokens=0)
        lm, tok = load_trained(args.model, auto, num_pages=s.pages_needed(16))
        data = eval_data(tok, s, corpus.split("eval"))
        ppl = {"auto": teacher_forced_ppl(lm, data.windows)}
        lm.configure_kv(fp8)
        ppl["fp8 eager"] = teacher_forced_ppl(lm, data.windows)
        ppl["fp8 compiled"] = teacher_forced_ppl(lm, data.windows, compiled(lm))
        for k, v in ppl.items():
            print(f"{k:13s} ppl {v:.4f}  ({100 * (v / ppl['auto'] - 1):+.3f}% vs auto)")
        doc["ppl"] = {"window": s.window, "windows": s.windows, "files": data.window_files, **ppl}
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
