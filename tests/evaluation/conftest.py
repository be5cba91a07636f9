"""Trained models, loaded once per test session (per xdist worker) from the converted cache
(the first run converts the GGUFs: tens of seconds each)."""

from __future__ import annotations

import pytest
import torch

from torch_kvq.integrations import trained, trained_sources

_LOADED: dict[str, tuple[torch.nn.Module, object]] = {}


def load(name: str) -> tuple[torch.nn.Module, object]:
    """(hf_model, tokenizer) of a shipped model in fp32, loaded once per process; a test that
    attaches the model detaches it."""
    if name not in _LOADED:
        _LOADED[name] = trained.load_hf(name, dtype=torch.float32)
    return _LOADED[name]


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: two OpenMP threads per xdist worker on a 2-core machine make small
    GEMMs far slower (see tests/integrations/conftest.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", params=sorted(trained_sources.SHIPPED))
def shipped(request):
    """(name, hf_model, tokenizer) of each shipped model."""
    return (request.param, *load(request.param))


@pytest.fixture(scope="session")
def smollm2():
    """(hf_model, tokenizer) of SmolLM2-135M, the smaller shipped model."""
    return load("smollm2-135m")
