"""Shared helpers for the GPU benchmarks: environment record, timers, copy bandwidth, data."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def environment() -> dict[str, Any]:
    """Date, GPU, driver and versions, recorded next to every number."""
    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = (
            f"{p.name} (sm{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
        )
        try:
            import flashinfer

            env["flashinfer"] = flashinfer.__version__
        except Exception as e:  # noqa: BLE001 - recorded, not hidden
            env["flashinfer"] = f"import failed: {e!r}"
        try:
            q = "--query-gpu=driver_version,clocks.sm,clocks.mem,power.draw"
            out = subprocess.run(
                ["nvidia-smi", q, "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            env["nvidia_smi"] = out.stdout.strip()
        except Exception as e:  # noqa: BLE001
            env["nvidia_smi"] = f"failed: {e!r}"
    return env


def time_per_call(
    fn: Callable[[], object], iters: int = 50, warmup: int = 5, reps: int = 3
) -> dict[str, float]:
    """Milliseconds per call, two ways (medians over ``reps``):

    ``ms``: CUDA events around ``iters`` back-to-back calls / iters (what a step pays: GPU time,
    or host time when the host cannot keep up); ``host_us``: host time to enqueue one call.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ms, host = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        ms.append(start.elapsed_time(end) / iters)
        host.append((t1 - t0) / iters * 1e6)
    return {
        "ms": statistics.median(ms),
        "ms_spread": max(ms) - min(ms),
        "host_us": statistics.median(host),
    }


def copy_bandwidth(nbytes: int = 2**31, iters: int = 20) -> dict[str, float]:
    """Device-to-device copy: (bytes read + bytes written) / time, GB/s (1e9)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t = time_per_call(lambda: dst.copy_(src), iters=iters)
    src = dst = None
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "ms": t["ms"], "GBps": 2 * nbytes / (t["ms"] * 1e-3) / 1e9}


def random_cache(
    pages: int, page_size: int, kv_heads: int, head: int, dtype: torch.dtype, std: float
) -> torch.Tensor:
    """[pages, 2, page_size, kv_heads, head] of N(0, std) cast to ``dtype`` (generated in chunks)."""
    cache = torch.empty((pages, 2, page_size, kv_heads, head), dtype=dtype, device="cuda")
    step = max(1, 2**28 // (2 * page_size * kv_heads * head))
    for i in range(0, pages, step):
        chunk = cache[i : i + step]
        chunk.copy_((torch.randn(chunk.shape, device="cuda") * std).to(dtype))
    return cache


def write_results(name: str, data: dict[str, Any], markdown: str) -> None:
    """Write ``name``.json under $OUT (or ./out) and print the markdown table.

    Only JSON is written: the device tool returns at most 8 files from $OUT.
    """
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2, default=str))
    print(markdown, flush=True)
