from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles from scratch: no cached frames, no recompile limit carried over."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
