from __future__ import annotations

import pytest
import torch

from tests.support.hf_families import release


@pytest.fixture(autouse=True)
def _fresh():
    """Each test starts with no compiled frames (Dynamo's recompile limit is per code object, and
    every HF family shares transformers' code) and with the last test's layer names free. One
    intra-op thread: these models are tiny, and two OpenMP threads per xdist worker on a 2-core
    machine made each small GEMM ~100x slower (measured: 3.0 s vs 0.023 s for a generate call)."""
    release()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    release()
