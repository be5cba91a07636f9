"""The kernel capability table the fusion passes consult."""

from __future__ import annotations

import pytest
import torch

from torch_kvq.attention.kernels import capabilities as caps
from torch_kvq.spec import KVQuantMode

FP8, NONE = KVQuantMode.FP8_PER_TENSOR, KVQuantMode.NONE


def test_reference_supports_everything_on_any_arch():
    for arch in ("cpu", "sm80", "sm90"):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for fp8_out in (False, True):
                assert caps.supports("reference", arch, FP8, dtype, fp8_out)
                assert caps.supports("reference", arch, NONE, dtype, fp8_out)


def test_exact_arch_row_wins_over_the_any_row():
    caps.register_capabilities("test-rows", "*", [(NONE, torch.bfloat16, False)])
    caps.register_capabilities("test-rows", "sm90", [(FP8, torch.bfloat16, True)])
    assert caps.supports("test-rows", "sm90", FP8, torch.bfloat16, True)
    assert not caps.supports("test-rows", "sm90", NONE, torch.bfloat16, False)
    assert caps.supports("test-rows", "sm80", NONE, torch.bfloat16, False)
    assert not caps.supports("test-rows", "sm80", FP8, torch.bfloat16, True)


def test_unknown_kernel_and_missing_arch_are_errors():
    with pytest.raises(ValueError, match=r"unknown kernel 'nope'; the capability table knows \["):
        caps.supports("nope", "cpu", FP8, torch.bfloat16, False)
    caps.register_capabilities("test-sm90-only", "sm90", [(FP8, torch.bfloat16, False)])
    with pytest.raises(
        ValueError,
        match=r"'test-sm90-only' has no capability row for arch 'cpu'; it has rows for \['sm90'\]",
    ):
        caps.supports("test-sm90-only", "cpu", FP8, torch.bfloat16, False)


@pytest.mark.parametrize(
    "kernel,arch,combos,match",
    [
        ("", "cpu", [], r"kernel name must be a non-empty string"),
        ("k", "", [], r"arch must be a non-empty string like 'cpu', 'sm90' or '\*'"),
        ("k", "cpu", [("fp8", torch.bfloat16, False)], r"expected \(KVQuantMode, q dtype in"),
        ("k", "cpu", [(FP8, torch.int8, False)], r"expected \(KVQuantMode, q dtype in"),
        ("k", "cpu", [(FP8, torch.bfloat16)], r"expected \(KVQuantMode, q dtype in"),
        ("k", "cpu", [(FP8, torch.bfloat16, 1)], r"bool fp8 output"),
    ],
)
def test_bad_rows_are_rejected(kernel, arch, combos, match):
    with pytest.raises(ValueError, match=match):
        caps.register_capabilities(kernel, arch, combos)


def test_device_arch_and_default_kernel():
    assert caps.device_arch("cpu") == "cpu"
    assert caps.default_kernel("cpu") == "reference"
    with pytest.raises(ValueError, match=r"device meta unsupported; expected a cpu or cuda device"):
        caps.device_arch("meta")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        assert caps.device_arch("cuda") == f"sm{major}{minor}"
