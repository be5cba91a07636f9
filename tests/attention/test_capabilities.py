"""The kernel capability table the fusion passes consult."""

from __future__ import annotations

import pytest
import torch

from torch_kvq.attention.kernels import capabilities as caps
from torch_kvq.spec_modes import KVQuantMode

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


# -- one table: the FlashInfer kernel's own check and the passes read the same rows ------------

FI_NAMES = ("flashinfer", "flashinfer-xqa", "flashinfer-decode", "flashinfer-xqa-decode")


def _fi_kernel(name: str):
    from torch_kvq.attention.kernels import FlashInferKernel

    kernel = FlashInferKernel(
        fp8_decode="xqa" if "xqa" in name else "tensor_cores",
        phases="decode" if name.endswith("decode") else "any",
    )
    assert kernel.name == name
    return kernel


def _layer(head_size=128, dtype=torch.bfloat16, page_size=16, fp8=True, soft_cap=None):
    from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig
    from torch_kvq.spec_resolve import resolve_layer_specs

    cfg = KVCacheConfig("fp8" if fp8 else "auto", page_size=page_size)
    info = AttentionLayerInfo("t.attn", 8, 2, head_size, logits_soft_cap=soft_cap)
    return resolve_layer_specs(cfg, [info], dtype)[0]


LAYERS = [
    _layer(),
    _layer(fp8=False),
    _layer(head_size=64),
    _layer(head_size=256, dtype=torch.float16),
    _layer(head_size=32),
    _layer(head_size=96, fp8=False),
    _layer(dtype=torch.float32),
    _layer(page_size=8),
    _layer(page_size=8, fp8=False),
    _layer(soft_cap=30.0),
]


def _on_gpu(monkeypatch, arch: str) -> None:
    major, minor = int(arch[2:-1]), int(arch[-1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (major, minor))


@pytest.mark.parametrize("arch", ["sm75", "sm80", "sm86", "sm87", "sm89", "sm90", "sm100",
                                  "sm103", "sm110", "sm120", "sm121"])  # fmt: skip
def test_flashinfer_check_supported_is_the_table(monkeypatch, arch):
    """For every configuration and layer, the kernel refuses exactly what the table refuses (an
    arch without a row included), and the passes fuse only layers the kernel serves."""
    from torch_kvq.attention.kernels import KernelUnsupportedError
    from torch_kvq.passes.stamp import make_stamp

    _on_gpu(monkeypatch, arch)
    for name in FI_NAMES:
        kernel = _fi_kernel(name)
        for spec in LAYERS:
            try:
                why = caps.unsupported_reason(name, arch, spec)
            except ValueError as e:
                assert f"has no capability row for arch {arch!r}" in str(e)
                why = str(e)
            try:
                kernel.check_supported(spec)
                refused = None
            except KernelUnsupportedError as e:
                refused = str(e)
            assert (refused is None) == (why is None), (name, arch, spec, why, refused)
            if refused is not None:
                assert why in refused and repr(kernel) in refused
                continue
            stamp = make_stamp(spec, name, arch)
            assert stamp.kv_in_place == spec.is_quantized, (name, arch, spec)
            assert kernel.fp8_output_supported(spec) == stamp.fp8_output


def test_measured_facts_are_in_the_table():
    """fa2 + tensor-core decode on sm80+; XQA (FP8 caches of the -xqa configurations) on sm90+;
    FP8 output only from the decode-only XQA configuration, only on sm90."""
    fa2 = ("sm80", "sm86", "sm87", "sm89", "sm90", "sm100", "sm103", "sm120", "sm121")
    xqa = ("sm90", "sm100", "sm103", "sm120", "sm121")
    fp8, bf16 = _layer(), _layer(fp8=False)
    for arch in fa2:
        for name in FI_NAMES:
            assert caps.unsupported_reason(name, arch, bf16) is None
            fp8_ok = "xqa" not in name or arch in xqa
            assert (caps.unsupported_reason(name, arch, fp8) is None) is fp8_ok, (name, arch)
            out = name == "flashinfer-xqa-decode" and arch == "sm90"
            assert caps.supports(name, arch, FP8, torch.bfloat16, True) is out, (name, arch)
    assert "sm75" not in caps.known_archs()


def test_head_size_page_size_and_soft_cap_limits():
    row = "flashinfer-xqa-decode"
    assert caps.unsupported_reason(row, "sm90", _layer(head_size=32)) == (
        "head size 32 is not supported; expected one of (64, 128, 256)"
    )
    assert caps.unsupported_reason(row, "sm90", _layer(page_size=8)) == (
        "page size 8 is not supported for FP8 caches; expected one of (16, 32, 64, 128)"
    )
    assert caps.unsupported_reason(row, "sm90", _layer(page_size=8, fp8=False)) is None
    assert "soft-cap" in caps.unsupported_reason(row, "sm90", _layer(soft_cap=30.0))
    assert caps.unsupported_reason("flashinfer", "sm90", _layer(soft_cap=30.0)) is None
    assert caps.unsupported_reason("flashinfer", "sm90", _layer(dtype=torch.float32)) == (
        "model dtype torch.float32 is not supported; expected bfloat16 or float16"
    )
    assert caps.unsupported_reason("reference", "sm75", _layer(head_size=32)) is None


def test_stamp_does_not_fuse_a_layer_outside_the_row():
    from torch_kvq.passes.stamp import make_stamp

    stamp = make_stamp(_layer(head_size=32), "flashinfer", "sm90")
    assert not stamp.kv_in_place and not stamp.fp8_output
    assert stamp.kv_block() == (
        "not fused: kernel 'flashinfer' on sm90 cannot serve it: head size 32 is not supported; "
        "expected one of (64, 128, 256)"
    )
    assert make_stamp(_layer(), "flashinfer-xqa-decode", "sm90").fp8_output
    with pytest.raises(ValueError, match=r"no capability row for arch 'sm75'; it has rows for"):
        make_stamp(_layer(fp8=False), "flashinfer", "sm75")


def test_known_archs_and_check_arch():
    assert caps.known_archs()[:3] == ("cpu", "sm80", "sm86")
    assert caps.check_arch("sm90") == "sm90"
    for bad in ("h200", "sm75", "SM90", ""):
        with pytest.raises(ValueError, match=rf"unknown arch {bad!r}; expected one of \['cpu', "):
            caps.check_arch(bad)


@pytest.mark.parametrize("kw", [{"head_sizes": (0,)}, {"head_sizes": ()}, {"fp8_page_sizes": "16"}])
def test_bad_row_limits_are_rejected(kw):
    with pytest.raises(ValueError, match=r"must be a non-empty collection of positive ints"):
        caps.register_capabilities("test-limits", "cpu", [], **kw)
