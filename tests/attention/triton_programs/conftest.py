"""Fixtures of the Triton program tests (cases and runners: ``tests.support.triton_case``, which
each test module imports first: it sets Triton's interpreter up and skips without Triton)."""

from __future__ import annotations

from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def interp() -> ModuleType:
    """``attention/triton/decode_tma`` under Triton's interpreter (CPU only)."""
    from tests.support.triton_case import INTERPRETING

    if not INTERPRETING:
        pytest.skip("interpreter tests run on a machine without CUDA (gpu tests cover the rest)")
    from torch_kvq.attention.triton import decode_tma

    return decode_tma


@pytest.fixture
def programs(monkeypatch):
    """Set the balanced schedule's program count (off CUDA it is per-SM x 132, capped)."""
    from torch_kvq.attention.triton import decode_balanced

    def force(n: int) -> None:
        monkeypatch.setattr(decode_balanced, "balanced_programs", lambda *a: n)

    return force
