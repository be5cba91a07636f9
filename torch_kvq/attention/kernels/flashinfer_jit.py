"""Build FlashInfer's JIT modules for a set of layers ahead of time, in parallel.

FlashInfer compiles one module per (q dtype, kv dtype, out dtype, head size, sliding, soft-cap)
for fa2 / fa3 and per (kv dtype, out dtype, page size, head size, GQA group, sliding) for XQA, on
first use (each takes a while; fa3's and XQA's longest). ``prebuild`` compiles exactly the modules
a ``FlashInferKernel`` will ask for these layers, concurrently (one ninja per module), so a first
batch does not stall. GPU only; imports flashinfer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from torch_kvq.attention.kernels.flashinfer import FlashInferKernel
from torch_kvq.attention.kernels.flashinfer_plan import GroupKey, import_flashinfer
from torch_kvq.spec import LayerKVSpec
from torch_kvq.spec_modes import FP8_DTYPE


def group_keys(
    kernel: FlashInferKernel, specs: Iterable[LayerKVSpec], phases: Sequence[str] | None = None
) -> list[tuple[GroupKey, int]]:
    """(group key, page size) of every plan ``kernel`` makes for ``specs`` in ``phases``."""
    if phases is None:
        phases = ("decode",) if kernel.phases == "decode" else ("prefill", "decode")
    out: dict[tuple[GroupKey, int], None] = {}
    for spec in specs:
        dtypes = [spec.storage_dtype]
        if spec.is_quantized and kernel.unfused_attention:
            dtypes.append(spec.model_dtype)
        for phase in phases:
            for kv in dtypes:
                out[(kernel._group_key(spec, kv, phase == "decode"), spec.page_size)] = None
    return list(out)


def jit_specs(
    kernel: FlashInferKernel,
    specs: Iterable[LayerKVSpec],
    phases: Sequence[str] | None = None,
    fp8_output: bool = False,
) -> dict[str, Any]:
    """FlashInfer ``JitSpec`` per module name; ``fp8_output`` adds XQA's FP8-output modules."""
    gen_batch_prefill_module = import_flashinfer(
        "flashinfer.jit.attention.modules"
    ).gen_batch_prefill_module
    gen_xqa_module = import_flashinfer("flashinfer.jit.xqa").gen_xqa_module

    out: dict[str, Any] = {}
    for key, page_size in group_keys(kernel, specs, phases):
        if key.kernel == "triton":  # ours: Triton compiles it on first call, no FlashInfer module
            continue
        if key.kernel == "xqa":
            outs = [key.q_dtype, FP8_DTYPE] if fp8_output else [key.q_dtype]
            for o in outs:
                js = gen_xqa_module(
                    key.q_dtype, key.kv_dtype, page_size, key.head_size,
                    key.num_heads // key.num_kv_heads, key.window is not None, o, 1, False,
                )  # fmt: skip
                out[js.name] = js
        else:
            js = gen_batch_prefill_module(
                key.backend, key.q_dtype, key.kv_dtype, key.o_dtype, torch.int32, key.head_size,
                key.head_size, 0, key.window is not None, bool(key.soft_cap), False,
            )  # fmt: skip
            out[js.name] = js
    return out


def build(modules: Mapping[str, Any], max_workers: int = 8) -> list[str]:
    """Compile the ``JitSpec`` values of ``modules`` not yet on disk, concurrently.

    While it runs, ``MAX_JOBS`` (ninja's -j, read by FlashInfer) is set so that the concurrent
    builds together use about one job per CPU core; it is restored afterwards.
    """
    todo = [js for js in modules.values() if not js.is_compiled]
    if not todo:
        return sorted(modules)
    workers = max(1, min(max_workers, len(todo)))
    saved = os.environ.get("MAX_JOBS")
    os.environ["MAX_JOBS"] = str(max(2, (os.cpu_count() or 8) // workers))
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(lambda js: js.build(need_lock=True), todo))
    finally:
        if saved is None:
            os.environ.pop("MAX_JOBS", None)
        else:
            os.environ["MAX_JOBS"] = saved
    return sorted(modules)


def prebuild(
    kernel: FlashInferKernel,
    specs: Iterable[LayerKVSpec],
    phases: Sequence[str] | None = None,
    fp8_output: bool = False,
    max_workers: int = 8,
) -> list[str]:
    """Compile the modules ``kernel`` needs for ``specs`` concurrently; returns their names."""
    return build(jit_specs(kernel, specs, phases, fp8_output), max_workers)
