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
