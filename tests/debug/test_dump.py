"""``kvq dump`` and ``kvq inspect``: files produced, their content, and clean errors."""

from __future__ import annotations

import json
import sys

import pytest

from torch_kvq.cli import main
from torch_kvq.passes.manager import DEFAULT_PASSES


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("dump")
    assert (
        main(
            [
                "dump",
                "--out",
                str(out),
                "--inner",
                "eager",
                "--skip",
                "sliding_window",
                "--skip",
                "0",
            ]
        )
        == 0
    )
    return out


def test_dump_writes_every_pass_before_after_diff_svg(dump_dir) -> None:
    graphs = sorted((dump_dir / "passes").glob("graph_*"))
    assert len(graphs) == 2  # prefill and decode graphs
    for g in graphs:
        for p in DEFAULT_PASSES:
            for suffix in (".before.py", ".after.py", ".diff", ".after.svg"):
                assert (g / f"{p}{suffix}").stat().st_size > 0 or suffix == ".diff", (
                    f"{g.name}/{p}{suffix}"
                )
        report = json.loads((g / "report.json").read_text())
        assert report["per_pass"]["fuse_quant_cache_write"]["matches"] == 2
        fused_write = (g / "fuse_quant_cache_write.diff").read_text()
        assert "+" in fused_write and "quant_cache_write" in fused_write


def first_graph(folder):
    """Dump folders are named after the process-wide graph id, so find the first one."""
    return sorted(folder.glob("graph_*"))[0]


def test_svg_shows_quantized_and_skipped_differently(dump_dir) -> None:
    svg = (first_graph(dump_dir / "passes") / "cleanup.after.svg").read_text()
    assert svg.startswith("<svg")
    assert (
        svg.count('class="fused"') == 4
    )  # 2 FP8 layers x (quant_cache_write, paged_attention_fp8)
    assert svg.count('class="skipped"') == 8  # 4 skipped layers x (cache_write, paged_attention)
    assert 'class="unfused"' not in svg
    before = (first_graph(dump_dir / "passes") / "annotate.after.svg").read_text()
    assert before.count('class="unfused"') == 10  # 2 x (2 quantize, write, dequantize, attention)
    assert "#c8e6c9" in svg and "#bbdefb" in svg  # the two fills differ


def test_depyf_plan_and_index(dump_dir) -> None:
    depyf_files = list((dump_dir / "depyf").glob("*.py"))
    assert any("full_code_for_forward" in f.name for f in depyf_files)
    assert any("Forward_graph" in f.name for f in depyf_files)
    assert "fp8_per_tensor" in (dump_dir / "plan.txt").read_text()
    index = (dump_dir / "index.html").read_text()
    graph = first_graph(dump_dir / "passes").name
    assert f'href="passes/{graph}/cleanup.after.svg"' in index and "depyf/" in index


def test_missing_depyf_is_a_clear_error(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "depyf", None)  # import depyf -> ImportError
    assert main(["dump", "--out", str(tmp_path / "d"), "--inner", "eager"]) == 2
    assert "install the debug extra" in capsys.readouterr().err


def test_unwritable_out(tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["dump", "--out", str(blocker / "sub"), "--inner", "eager"]) == 2
    assert "cannot write to --out" in capsys.readouterr().err


def test_unknown_preset_exits_2(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["dump", "--out", str(tmp_path), "--preset", "gpt9"])
    assert e.value.code == 2 and "invalid choice: 'gpt9'" in capsys.readouterr().err


def test_bad_config_exits_2(tmp_path, capsys) -> None:
    assert main(["inspect", "--skip", "slidng_window"]) == 2
    assert "unknown skip rule 'slidng_window'" in capsys.readouterr().err
    assert main(["inspect", "--kv-cache-dtype", "fp9"]) == 2
    assert "unknown kv_cache_dtype 'fp9'" in capsys.readouterr().err


def test_inspect_table_and_json(capsys) -> None:
    assert main(["inspect"]) == 0
    text = capsys.readouterr().out
    assert "2 of 6 layers quantized" in text
    assert "quant+write, dequant+attention" in text and "kept bf16 (skipped" in text
    assert (
        main(
            [
                "inspect",
                "--json",
                "--arch",
                "sm90",
                "--kernel",
                "flashinfer-xqa-decode",
                "--no-skip",
                "--head-dim",
                "128",  # FlashInfer's head sizes are 64, 128, 256; the presets have 32
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 6 and all(r["mode"] == "fp8_per_tensor" for r in rows)
    assert all(
        r["output_quant"].startswith("fusable") and r["kernel"] == "flashinfer-xqa-decode"
        for r in rows
    )
    assert rows[0]["cache_bytes_per_token"] * 2 == 2 * 2 * 128 * 2  # fp8: half of bf16


def test_inspect_unknown_kernel(capsys) -> None:
    assert main(["inspect", "--kernel", "nope"]) == 2
    assert "unknown kernel 'nope'" in capsys.readouterr().err


def test_accuracy_command(tmp_path, capsys) -> None:
    assert (
        main(["accuracy", "--plot", str(tmp_path / "a.png"), "--json", str(tmp_path / "a.json")])
        == 0
    )
    out = capsys.readouterr().out
    assert "SQNR dB" in out and "suggested skip_layers" in out
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads((tmp_path / "a.json").read_text())["layers"]) == 6
    assert main(["accuracy", "--plot", str(tmp_path / "nope" / "a.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_dump_dir_from_environment(tmp_path, monkeypatch) -> None:
    import torch

    from torch_kvq.models import build_model, generate
    from torch_kvq.passes import make_kvq_backend
    from torch_kvq.spec import KVCacheConfig

    monkeypatch.setenv("TORCH_KVQ_DUMP_DIR", str(tmp_path / "env"))
    model = build_model("llama-tiny", KVCacheConfig("fp8", skip_layers=(0,)))
    torch._dynamo.reset()
    generate(
        model, [[1, 2, 3]], 1, forward=torch.compile(model, backend=make_kvq_backend(inner="eager"))
    )
    graph = first_graph(tmp_path / "env")
    assert (graph / "fuse_dequant_attention.after.svg").exists()
    assert (
        json.loads((graph / "report.json").read_text())["per_pass"]["fuse_dequant_attention"][
            "matches"
        ]
        == 3
    )
