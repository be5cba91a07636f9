"""Suite-wide fixtures."""

from __future__ import annotations

import pytest

from torch_kvq.attention.kernels import capabilities


@pytest.fixture(autouse=True)
def _restore_capability_table():
    """Rows a test registers (``register_capabilities``) are removed after it, so no test sees
    another's kernels."""
    saved = {kernel: dict(rows) for kernel, rows in capabilities._TABLE.items()}
    yield
    capabilities._TABLE.clear()
    capabilities._TABLE.update(saved)


@pytest.fixture
def deterministic_inductor():
    """Inductor without on-device benchmarking that changes numerics (``deterministic``): by
    default it times each generated reduction's candidate configs (RBLOCK, num_warps) at the first
    call and keeps the fastest, so two compiles of one model on a busy GPU (the suite's workers
    share it, and Inductor's on-disk autotune cache) can pick different reduction orders and
    differ in the last bits. Tests that compare two compiled copies bit for bit take this."""
    import torch

    with torch._inductor.config.patch(deterministic=True):
        yield
