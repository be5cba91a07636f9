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
