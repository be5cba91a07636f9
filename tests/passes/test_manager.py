"""KVQPassManager: uuid (FX graph cache key), validation, report, log line, dumps, fake tensors."""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys

import pytest
import torch

from tests.support.passes import capture_graph, make_specs, nodes_of, run_passes, small_case
from torch_kvq import make_kvq_backend
from torch_kvq.attention import ReferenceKernel, forward_context
from torch_kvq.passes import DEFAULT_PASSES, GraphReport, KVQPass, KVQPassManager, last_report
from torch_kvq.passes.graph_utils import ATTENTION_FP8, QUANT_CACHE_WRITE, VIEW_OPS
from torch_kvq.passes.stamp import get_stamp
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig
from torch_kvq.spec_resolve import resolve_layer_specs

UUID_SCRIPT = """
import torch
from torch_kvq.passes import KVQPassManager
from torch_kvq.spec import AttentionLayerInfo, KVCacheConfig
from torch_kvq.spec_resolve import resolve_layer_specs
infos = [AttentionLayerInfo(f"m.layers.{i}", 8, 2, 32, sliding_window=4 if i % 2 else None) for i in range(4)]
specs = resolve_layer_specs(KVCacheConfig("fp8", skip_layers=("sliding_window",)), infos, torch.bfloat16)
print(KVQPassManager(specs).uuid())
"""


def fixed_specs(skip=("sliding_window",), dtype="fp8"):
    infos = [
        AttentionLayerInfo(f"m.layers.{i}", 8, 2, 32, sliding_window=4 if i % 2 else None)
        for i in range(4)
    ]
    return resolve_layer_specs(KVCacheConfig(dtype, skip_layers=skip), infos, torch.bfloat16)


def test_uuid_hashes_spec_table_passes_and_kernel():
    base = KVQPassManager(fixed_specs())
    assert (
        isinstance(base.uuid(), str) and len(base.uuid()) == 64
    )  # truthy: the FX graph cache stays on
    assert KVQPassManager(fixed_specs()).uuid() == base.uuid()
    others = [
        KVQPassManager(fixed_specs(skip=(0,))),  # another skip config
        KVQPassManager(fixed_specs(skip=(1, 3))),  # same layers skipped, other rule text
        KVQPassManager(fixed_specs(dtype="auto")),
        KVQPassManager(fixed_specs(), passes=["annotate", "cleanup"]),
        KVQPassManager(fixed_specs(), kernel="flashinfer", arch="sm90"),
    ]
    uuids = {m.uuid() for m in others}
    assert base.uuid() not in uuids and len(uuids) == len(others)


def test_uuid_is_stable_across_processes():
    out = subprocess.run(
        [sys.executable, "-c", UUID_SCRIPT], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == KVQPassManager(fixed_specs()).uuid()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"passes": ["annotate", "fuse_everything"]},
            r"unknown passes \['fuse_everything'\]; known passes",
        ),
        ({"passes": ["fuse_dequant_attention", "annotate"]}, r"'annotate' must run before them"),
        ({"passes": ["cleanup", "cleanup"]}, r"lists a pass twice"),
        ({"passes": "annotate"}, r"sequence of pass names"),
        (
            {"kernel": "no-such-kernel"},
            r"unknown kernel 'no-such-kernel'; the capability table knows",
        ),
        ({"kernel": {"m.layers.0": "reference"}}, r"kernel mapping has no entry for layers"),
        ({"kernel": "reference", "arch": "sm75x"}, None),  # the reference kernel serves any arch
    ],
)
def test_bad_options_are_rejected(kwargs, match):
    if match is None:
        KVQPassManager(fixed_specs(), **kwargs)
        return
    with pytest.raises(ValueError, match=match):
        KVQPassManager(fixed_specs(), **kwargs)


def test_duplicate_specs_rejected():
    specs = fixed_specs()
    with pytest.raises(ValueError, match=r"specs name a layer twice: \['m.layers.0'\]"):
        KVQPassManager([specs[0], specs[0]])


def test_report_log_line_and_last_report(caplog):
    model, md, inputs = small_case("op")
    gm = capture_graph(model, inputs, md)
    with caplog.at_level(logging.INFO, logger="torch_kvq"):
        manager = run_passes(gm, model.specs, DEFAULT_PASSES)
    rep = manager.last
    assert last_report() is rep and isinstance(rep, GraphReport)
    lines = [r.getMessage() for r in caplog.records if r.name == "torch_kvq"]
    assert len(lines) == 1  # one summary line per compiled graph
    assert "3 attention layers (2 fp8_per_tensor, 1 kept unquantized)" in lines[0]
    assert "fused quant+write 2, dequant+attn 2, output quant 2" in lines[0]
    assert list(rep.per_pass) == list(DEFAULT_PASSES)
    names = [s.name for s in model.specs]
    assert list(rep.per_layer) == names
    assert (
        rep.fused(names[0])
        == rep.fused(names[2])
        == ("quant+write", "dequant+attn", "output quant")
    )
    assert rep.fused(names[1]) == ()
    assert rep.per_pass["fuse_attention_output_quant"].matches == 2
    assert all(s.time_s >= 0 for s in rep.per_pass.values()) and rep.time_s > 0
    assert (
        rep.ops_before["kvq.dequantize_kv_cache"] == 2
        and "kvq.dequantize_kv_cache" not in rep.ops_after
    )
    text = rep.format()
    for name in names:
        assert name in text
    assert "kept bf16 (skipped: skip rule 1)" in text and "fused output quant" in text
    assert GraphReport.from_json(rep.to_json()).per_layer == rep.per_layer


def test_dumps_are_named_after_the_passes(tmp_path):
    model, md, inputs = small_case("torch")
    gm = capture_graph(model, inputs, md)
    manager = run_passes(gm, model.specs, DEFAULT_PASSES, dump_dir=tmp_path)
    (folder,) = tmp_path.iterdir()
    assert manager.last.dump_dir == str(folder)
    kinds = ("before.py", "after.py", "diff", "after.svg")
    expected = {f"{p}.{w}" for p in DEFAULT_PASSES for w in kinds} | {
        "report.txt",
        "report.json",
    }
    assert {f.name for f in folder.iterdir()} == expected
    before = (folder / "fuse_quant_cache_write.before.py").read_text()
    after = (folder / "fuse_quant_cache_write.after.py").read_text()
    assert "kvq.cache_write.default" in before and "quant_cache_write" not in before
    assert after.count("kvq.quant_cache_write.default") == 2 and "def forward" in after
    assert "fused output quant" in (folder / "report.txt").read_text()
    run_passes(capture_graph(model, inputs, md), model.specs, ["annotate"], dump_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2  # a new folder per compiled graph


def test_inductors_fake_tensor_updater_fills_the_new_nodes():
    """What Inductor does after the custom post pass: ``incremental_update()`` computes
    ``meta["val"]`` for the nodes the fusions created (we never write it ourselves)."""
    import torch._inductor.fx_passes.reinplace  # noqa: F401 - torch 2.11's updater reads it unimported
    from torch._guards import detect_fake_mode
    from torch._inductor.fx_utils import FakeTensorUpdater
    from torch._inductor.virtualized import V

    model, md, inputs = small_case("op")
    gm = capture_graph(model, inputs, md)
    fake_mode = detect_fake_mode([n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")])
    # torch 2.11 takes the graph, 2.13 the GraphModule
    first = next(iter(inspect.signature(FakeTensorUpdater).parameters))
    updater = FakeTensorUpdater(gm.graph if first == "graph" else gm)
    run_passes(gm, model.specs, DEFAULT_PASSES)
    new = nodes_of(gm, QUANT_CACHE_WRITE) + nodes_of(gm, ATTENTION_FP8)
    assert new and all("val" not in n.meta for n in new)
    with V.set_fake_mode(fake_mode):
        updater.incremental_update()
    for attn in nodes_of(gm, ATTENTION_FP8):
        assert attn.meta["val"].dtype == torch.float8_e4m3fn  # output_scale -> FP8 output
        assert tuple(attn.meta["val"].shape) == tuple(inputs[0].shape)
        (view,) = attn.users
        assert view.target in VIEW_OPS and view.meta["val"].shape == (inputs[0].shape[0], 8 * 32)
    for write in nodes_of(gm, QUANT_CACHE_WRITE):
        (getitem,) = write.users
        assert getitem.meta["val"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize(
    "edited",
    [
        "capabilities.py",
        "report.py",
        "spec.py",
        "spec_channels.py",
        "spec_modes.py",
        "spec_resolve.py",
        "spec_table.py",
    ],
)
def test_cache_key_covers_every_source_the_passes_run(monkeypatch, edited):
    """Editing a helper module (not only a pass's own module or common.py) changes uuid(), so
    Inductor's FX graph cache cannot serve a graph the edited code would compile differently."""
    from pathlib import Path

    from torch_kvq.passes import manager as m

    specs = make_specs(1)
    m._package_digest.cache_clear()
    before = m.KVQPassManager(specs).uuid()
    real = Path.read_bytes
    monkeypatch.setattr(
        Path, "read_bytes", lambda p: real(p) + (b"# edited" if p.name == edited else b"")
    )
    m._package_digest.cache_clear()
    try:
        after = m.KVQPassManager(specs).uuid()
    finally:
        monkeypatch.undo()
        m._package_digest.cache_clear()
    assert before != after


class TagAttentionPass(KVQPass):
    """A user pass: tags every stamped attention node's layer (a decision, no rewrite)."""

    name = "tag_attention"
    reads_stamps = True
    fusion = "tagged"

    def __call__(self, graph, ctx):
        matches = 0
        for node in nodes_of_graph(graph, ATTENTION_FP8):
            ctx.decide(get_stamp(node).layer, self.decision())
            matches += 1
        return matches


class OtherTagPass(TagAttentionPass):
    """Same name, other source: another cache key."""

    def __call__(self, graph, ctx):
        return 0


def nodes_of_graph(graph, op):
    return [n for n in graph.nodes if n.op == "call_function" and n.target is op]


def test_user_pass_object_runs_through_make_kvq_backend():
    model, md, inputs = small_case("op")
    passes = [*DEFAULT_PASSES[:-1], TagAttentionPass(), "cleanup"]
    backend = make_kvq_backend(inner="eager", passes=passes, kernel="reference")
    torch._dynamo.reset()
    with torch.no_grad(), forward_context(md, model.specs, ReferenceKernel()):
        torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    rep = backend.managers[-1].last
    assert list(rep.per_pass) == [*DEFAULT_PASSES[:-1], "tag_attention", "cleanup"]
    assert rep.per_pass["tag_attention"].matches == 2  # the two FP8 layers
    names = [s.name for s in model.specs]
    assert rep.per_layer[names[0]]["tag_attention"] == "fused tagged"
    assert "tagged" in rep.fused(names[0]) and "tag_attention" in rep.format()
    assert "output quant 2, tagged 2" in rep.summary()


def test_user_pass_object_is_part_of_the_cache_key():
    specs = fixed_specs()
    plain = KVQPassManager(specs, passes=["annotate", "cleanup"])
    tagged = KVQPassManager(specs, passes=["annotate", TagAttentionPass(), "cleanup"])
    other = KVQPassManager(specs, passes=["annotate", OtherTagPass(), "cleanup"])
    again = KVQPassManager(specs, passes=["annotate", TagAttentionPass(), "cleanup"])
    assert len({plain.uuid(), tagged.uuid(), other.uuid()}) == 3
    assert again.uuid() == tagged.uuid()


def test_user_pass_objects_are_checked():
    class NoKey(TagAttentionPass):
        def uuid(self):
            return None

    specs = fixed_specs()
    with pytest.raises(ValueError, match=r"pass names or KVQPass objects.*\(a class: pass an"):
        KVQPassManager(specs, passes=["annotate", TagAttentionPass])
    with pytest.raises(ValueError, match=r"'annotate' must run before them \(before \['tag_"):
        KVQPassManager(specs, passes=[TagAttentionPass(), "annotate"])
    with pytest.raises(ValueError, match=r"uuid\(\) returned None"):
        KVQPassManager(specs, passes=["annotate", NoKey()])
