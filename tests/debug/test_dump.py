"""``kvq dump`` and ``kvq inspect``: files produced, their content, and clean errors."""

from __future__ import annotations

import json

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


def test_index_reads_in_pass_order_with_phases_pictures_and_fusions(dump_dir) -> None:
    index = (dump_dir / "index.html").read_text()
    first, second = sorted(p.name for p in (dump_dir / "passes").glob("graph_*"))
    assert f"{first}: prefill graph" in index and f"{second}: decode graph" in index
    section = index[index.index(f'id="{first}"') : index.index(f'id="{second}"')]
    at = [section.index(f"<li><b>{p}</b>") for p in DEFAULT_PASSES]
    assert at == sorted(at)  # the order the passes ran, not alphabetical
    assert section.count("<svg") == len(DEFAULT_PASSES)  # pictures inline
    assert "fused quant+write 2, dequant+attn 2, output quant 0" in section  # the summary
    assert '<td class="fused">fused dequant+attn</td>' in section  # per layer
    assert "(Stamp every kvq op node" in section  # what each pass does


def test_depyf_warning_a_user_cannot_act_on_is_silenced(tmp_path) -> None:
    import warnings

    import torch

    from torch_kvq.cli.dump import _depyf_context

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with _depyf_context(tmp_path, True):
            torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    torch._dynamo.reset()
    assert not [w for w in seen if "trying to debug" in str(w.message)], [
        str(w.message) for w in seen
    ]


def test_phase_labels_count_by_graph_id_when_the_report_list_is_full() -> None:
    """recent_reports() keeps the newest 64; a dump run late in a process still finds its graphs."""
    from torch_kvq.cli.dump import _label, _last_graph_id
    from torch_kvq.passes import report

    def add(folder):
        report.record(report.GraphReport(report.next_graph_id(), {}, {}, {}, {}, 0.0, folder))

    for _ in range(70):
        add(None)
    seen = _last_graph_id()
    add("/x/passes/graph_900")
    phases: dict[str, str] = {}
    assert [r.dump_dir for r in _label(seen, "decode", phases)] == ["/x/passes/graph_900"]
    assert phases == {"graph_900": "decode"}


# -- a per-layer map with issue 33's 4-bit modes ------------------------------------------------

MAP_MODES = ["int4_per_token_head", "k8v4_per_token_head", "int8_per_token_head", "none"]


@pytest.fixture(scope="module")
def map_dump_dir(tmp_path_factory):
    """``kvq dump`` of llama-tiny (bf16, 2 kv heads of 32, 64 pages of 16) with layer 0 int4,
    1 k8v4, 2 int8 per (token, head), 3 kept in bf16."""
    out = tmp_path_factory.mktemp("dump_map")
    kv_map = "0:int4_per_token_head,1:k8v4_per_token_head,2:int8_per_token_head"
    argv = ["dump", "--out", str(out), "--inner", "eager", "--no-depyf", "--preset", "llama-tiny",
            "--kv-cache-dtype", "auto", "--kv-map", kv_map]  # fmt: skip
    assert main(argv) == 0
    return out


def test_map_dump_plan_names_each_layers_mode_cache_shape_and_bytes(map_dump_dir) -> None:
    plan = (map_dump_dir / "plan.txt").read_text()
    table, caches = plan.split("caches of this model:\n")
    rows = {int(line.split()[0]): line.split() for line in table.splitlines() if line[:1].isdigit()}
    # per token, 2 kv heads of 32: int4 2 x 2 x (16 + 4), k8v4 2 x (32 + 16 + 2 x 4), int8
    # 2 x 2 x (32 + 4), bf16 2 x 2 x 64; each row: idx, layer, type, mode, cache dtype, bytes, ...
    got = [(r[3], r[4], int(r[5])) for _, r in sorted(rows.items())]
    assert got == [(MAP_MODES[0], "uint8", 80), (MAP_MODES[1], "uint8", 112),
                   (MAP_MODES[2], "int8", 144), ("none", "bfloat16", 256)]  # fmt: skip
    lines = [line for line in caches.splitlines() if ".layers." in line.split(" ", 1)[0]]
    assert [line.split()[1] for line in lines] == MAP_MODES
    # codes [pages, slots, page, KH, code_dim]: k8v4 3 slots, the 4-bit modes D / 2 per byte
    assert "uint8 [64, 2, 16, 2, 16]" in lines[0] and "uint8 [64, 3, 16, 2, 16]" in lines[1]
    assert "int8 [64, 2, 16, 2, 32]" in lines[2] and "bfloat16 [64, 2, 16, 2, 32]" in lines[3]
    assert all("float32 [64, 2, 2, 16]" in line for line in lines[:3]) and " - " in lines[3]
    # a layer's bytes: its bytes per token times 64 pages of 16 tokens
    assert [int(line.split()[-1]) for line in lines] == [b * 64 * 16 for _, _, b in got]


def test_map_dump_reports_fuse_the_quantized_layers_of_each_mode(map_dump_dir) -> None:
    graphs = sorted((map_dump_dir / "passes").glob("graph_*"))
    assert len(graphs) == 2  # prefill and decode
    for g in graphs:
        report = json.loads((g / "report.json").read_text())
        summary = (g / "report.txt").read_text().splitlines()[0]  # the passes' report, per mode
        assert ("4 attention layers (1 int4_per_token_head, 1 int8_per_token_head, 1 "
                "k8v4_per_token_head, 1 kept unquantized); fused quant+write 3, dequant+attn 3, "
                "output quant 0") in summary, summary  # fmt: skip
        layers = sorted(report["layers"].items(), key=lambda kv: kv[1]["index"])
        assert [info["mode"] for _, info in layers] == MAP_MODES
        names = [name for name, _ in layers]
        for pass_name, fused in (("fuse_quant_cache_write", "fused quant+write"),
                                 ("fuse_dequant_attention", "fused dequant+attn")):  # fmt: skip
            decisions = report["per_pass"][pass_name]["decisions"]
            assert [decisions[n] for n in names[:3]] == [fused] * 3, (g.name, pass_name)
            assert decisions[names[3]].startswith("kept bf16"), (g.name, pass_name)
        code = (g / "cleanup.after.py").read_text()
        assert code.count("torch.ops.kvq.quant_cache_write_per_token_head.default") == 3
        assert code.count("torch.ops.kvq.paged_attention_per_token_head.default") == 3
        for unfused in ("quantize_per_token_head", "cache_write_per_token_head",
                        "dequantize_kv_cache_per_token_head"):  # fmt: skip
            assert f"torch.ops.kvq.{unfused}.default" not in code, (g.name, unfused)
        before = (g / "annotate.after.py").read_text()  # the same graph before the fusions
        assert before.count("torch.ops.kvq.quantize_per_token_head.default") == 6
        # the caches flow through the graph with their shapes: int4's and k8v4's uint8 codes
        assert '"u8[64, 2, 16, 2, 16]"' in code and '"u8[64, 3, 16, 2, 16]"' in code
        svg = (g / "cleanup.after.svg").read_text()
        assert svg.count('class="fused"') == 6  # 3 layers x (quant_cache_write, attention)
        assert svg.count('class="skipped"') == 2 and 'class="unfused"' not in svg


def test_map_dump_index_names_the_map_and_each_layers_mode(map_dump_dir) -> None:
    index = (map_dump_dir / "index.html").read_text()
    title = "layer_modes ((0, &#x27;int4_per_token_head&#x27;), (1, &#x27;k8v4_per_token_head"
    assert title in index
    assert "fused quant+write 3, dequant+attn 3, output quant 0" in index
    for mode in MAP_MODES[:3]:
        assert f"<td>{mode}</td><td>reference@cpu</td>" in index, mode
