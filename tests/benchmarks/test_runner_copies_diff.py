"""scripts/runner_copies_diff.py on the CPU (reference kernel, eager): two copies of the graph
runner's map test agree after the prefill and every step (the second running each padded size's
first step three times, as a capture's warm-ups do), a difference in one copy's cache is
reported by layer, page and owning sequence, and ``--trace`` names the first module whose
output differs."""

from __future__ import annotations

import torch
from runner_copies_diff import Tracer, _build, cache_diff, run_copies

from tests.attention.test_graph_runner import PROMPTS, SCHEDULE, _prefill


def test_two_cpu_copies_agree_after_the_prefill_and_every_step() -> None:
    # W: each padded size's first step run three times, as a capture's warm-ups do
    res = list(run_copies(["int4_per_token_head"], "cpu", "FW", eager=True, attend=True))
    assert all(r["copies"] == ["F", "W"] for r in res)
    assert [r["point"] for r in res] == ["prefill"] + [f"step {i}" for i in range(len(SCHEDULE))]
    assert all(r["caches"] == {} for r in res)
    assert all(r["rows_differ"] == [] and r["max_abs"] == 0.0 for r in res[1:])
    assert [r["seqs"] for r in res[1:]] == [list(s) for s in SCHEDULE]
    calls = res[0]["calls"]
    assert [c["layer"] for c in calls] == [f"layers.{i}" for i in range(6)]  # one prefill each
    assert all(c["out_equal"] and c["pages_equal"] and c["scales_equal"] for c in calls)


def test_cache_diff_names_the_layer_page_and_sequence() -> None:
    models = []
    for _ in range(2):
        m, _fn, _runner = _build("k8v4_per_token_head", "cpu", "F", None, eager=True, static=False)
        _prefill(m, PROMPTS, torch.Generator().manual_seed(0), m)
        models.append(m)
    assert cache_diff(*models) == {}
    (page,) = models[1].allocator.pages(2)  # sequence 2: 3 tokens, one page
    models[1].attention_layers[2].kv_scale[page, 1, 0, 1] += 1.0
    assert cache_diff(*models) == {"layers.2": [[page, 2]]}
    models[1].attention_layers[4].kv_cache[page, 0, 0] += 1.0  # a bf16 layer's k
    assert cache_diff(*models) == {"layers.2": [[page, 2]], "layers.4": [[page, 2]]}


def test_the_trace_names_the_first_module_whose_output_differs() -> None:
    tracer = Tracer()
    for copy in range(2):
        m, _fn, _runner = _build("int4_per_token_head", "cpu", "F", None, eager=True, static=False)
        if copy:
            with torch.no_grad():
                m.layers[3].mlp.down_proj.weight[0, 0] += 0.5  # row 0 of every token's output
        tracer.hook(m)
        tracer.on = True
        _prefill(m, PROMPTS, torch.Generator().manual_seed(0), m)
        tracer.on = False
    names = [name for name, _ in tracer.copies[0]]
    assert names == [name for name, _ in tracer.copies[1]] and "layers.3.mlp.down_proj" in names
    first = tracer.first_differences(1)
    assert first[0]["module"] == "layers.3.mlp.down_proj"
    assert first[0]["shape"] == [sum(PROMPTS.values()), m.config.hidden_size]
    assert first[0]["nan"] == [0, 0] and first[0]["rows"]
    assert len(first) == 8  # the limit: layer 3's MLP on, every later module differs too
