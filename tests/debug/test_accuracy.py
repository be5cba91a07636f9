"""Per-layer FP8 accuracy report."""

from __future__ import annotations

import json

import pytest
import torch

from torch_kvq.debug.accuracy import layer_accuracy
from torch_kvq.models import build_model
from torch_kvq.spec import KVCacheConfig


@pytest.fixture(scope="module")
def model_and_prompts():
    cfg = KVCacheConfig("fp8", skip_layers=("sliding_window",))
    model = build_model("gemma3-tiny", cfg)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, 7, 13)]
    return model, prompts, cfg


def test_every_layer_measured_with_configured_mode(model_and_prompts, tmp_path) -> None:
    model, prompts, cfg = model_and_prompts
    free_before = model.allocator.num_free_pages
    report = layer_accuracy(model, prompts, cfg, threshold_db=30.0)
    assert model.allocator.num_free_pages == free_before  # pages of the sample were returned
    assert [la.index for la in report.layers] == list(range(6))
    assert [la.configured_mode for la in report.layers] == [s.mode.value for s in model.kv_specs]
    for la in report.layers:
        assert 15.0 < la.sqnr_db < 60.0  # FP8 is lossy but close
        assert 0.0 < la.rel < 0.2 and la.max_abs > 0.0
        assert la.flagged == (la.sqnr_db < 30.0)
    data = json.loads(report.to_json())
    assert data["suggested_skip_layers"] == list(report.suggested_skip_layers)
    assert "suggested skip_layers" in report.format()
    report.plot(str(tmp_path / "acc.png"))
    assert (tmp_path / "acc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_threshold_flags_and_suggests(model_and_prompts) -> None:
    model, prompts, cfg = model_and_prompts
    everything = layer_accuracy(model, prompts, cfg, threshold_db=100.0)
    assert everything.suggested_skip_layers == tuple(range(6))
    nothing = layer_accuracy(model, prompts, cfg, threshold_db=0.0)
    assert nothing.suggested_skip_layers == ()


def test_bad_scales_hurt_and_calibration_fixes(model_and_prompts) -> None:
    model, prompts, _ = model_and_prompts
    tiny = KVCacheConfig("fp8", default_k_scale=1e-4, default_v_scale=1e-4)  # everything saturates
    bad = layer_accuracy(model, prompts, tiny)
    good = layer_accuracy(model, prompts, tiny, calibrate=True)
    assert all(b.sqnr_db < 10.0 for b in bad.layers)
    assert all(g.sqnr_db > 25.0 for g in good.layers)
    assert good.scales == "calibrated" and all(g.k_scale != 1e-4 for g in good.layers)


def test_bad_threshold(model_and_prompts) -> None:
    model, prompts, cfg = model_and_prompts
    with pytest.raises(ValueError, match="threshold_db must be a finite number"):
        layer_accuracy(model, prompts, cfg, threshold_db=float("nan"))


def test_format_names_layers_and_marks_kept_rows(model_and_prompts) -> None:
    model, prompts, cfg = model_and_prompts
    text = layer_accuracy(model, prompts, cfg, threshold_db=0.0).format()
    for spec in model.kv_specs:
        (row,) = [line for line in text.splitlines() if f"  {spec.name}  " in line]
        # a kept layer's error columns are what FP8 would cost, and its row says so
        assert ("kept bf16" in row and "if it were quantized" in row) == (not spec.is_quantized)
    assert "layers below it: none" in text
    assert (
        "suggested skip_layers: nothing to add (your config keeps layers 0, 1, 3, 4 in bf16)"
        in text
    )
    flagged = layer_accuracy(model, prompts, cfg, threshold_db=100.0).format()
    assert "layers below it: 0, 1, 2, 3, 4, 5" in flagged
    assert "also keep layers 2, 5 unquantized" in flagged  # 0, 1, 3, 4 are kept already
