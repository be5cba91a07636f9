"""benchmarks/tma_variants.py: each variant of the TMA decode kernel, built from the package
kernel's source, computes the reference attention (Triton's interpreter, fp32 products; the GPU
measurement is ``bench_fp8_decode_paths.py --vperm-study``). Without Triton, or on a machine with
CUDA (no interpreter there), these skip, as ``test_triton_decode_tma``'s interpreter tests do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "attention"))  # sets TRITON_INTERPRET before Triton loads
sys.path.insert(0, str(ROOT / "benchmarks"))
from test_triton_decode_tma import (  # noqa: E402
    test_interpreter_lazy_rescale_matches_reference as lazy_matches_reference,
)
from test_triton_decode_tma import (  # noqa: E402
    test_interpreter_matches_reference as matches_reference,
)
from triton_case import INTERPRETING  # noqa: E402


@pytest.fixture(scope="module")
def natural(tmp_path_factory):
    if not INTERPRETING:
        pytest.skip("interpreter tests run on a machine without CUDA")
    from tma_variants import load_variant

    return load_variant("natural", tmp_path_factory.mktemp("variants"))


@pytest.mark.parametrize("qh,kh,d", [(8, 2, 128), (4, 2, 256), (4, 4, 64)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (100, 5.0)], ids=["global", "swa_cap"])
@pytest.mark.parametrize("ppi,num_splits", [(1, 1), (2, 3), (4, 2)])
def test_natural_matches_reference(natural, qh, kh, d, window, soft_cap, ppi, num_splits):
    """The package kernel's interpreter checks, run on the variant."""
    matches_reference(natural, qh, kh, d, num_splits, window, soft_cap, ppi)
    if ppi < 4:
        lazy_matches_reference(natural, qh, kh, d, window, soft_cap, 20.0, ppi, num_splits)


def test_a_variant_whose_anchor_moved_is_refused(monkeypatch) -> None:
    import tma_variants

    monkeypatch.setitem(tma_variants.VARIANTS, "gone", [("no such line\n", "x")])
    with pytest.raises(ValueError, match="variant 'gone': edit 0 expects its anchor 1 time"):
        tma_variants.variant_source("gone")
