"""Fixtures of the attention tests (helpers: ``tests.support.attention``)."""

from __future__ import annotations

import pytest
import torch

from torch_kvq.attention import PageAllocator


@pytest.fixture
def alloc() -> PageAllocator:
    return PageAllocator(num_pages=16, page_size=4)


@pytest.fixture
def fp8_safe_allclose(monkeypatch):
    """opcheck's schema check compares inputs before/after with torch.allclose, which has no
    kernel for float8 (torch 2.13). Compare fp8 tensors bitwise instead; the check stays as strict."""
    allclose = torch.allclose

    def fp8_safe(a, b, *args, **kwargs):
        if a.dtype == torch.float8_e4m3fn:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return allclose(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", fp8_safe)
