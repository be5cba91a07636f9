"""scripts/hf_copies_diff.py on the CPU (reference kernel, eager): two copies of the HF map
test's model agree everywhere, every prefill attention call is recorded and compared, and a
difference in one recorded call is reported where it is."""

from __future__ import annotations

import pytest
import torch
from hf_copies_diff import compare_calls, run_copies


@pytest.fixture(scope="module")
def two_copies() -> dict:
    (res,) = run_copies("tc4_per_token_head", "cpu", "PP", eager=True, attend=True)
    return res


def test_two_cpu_copies_agree_on_every_layer_and_call(two_copies: dict) -> None:
    assert two_copies["copies"] == ["P", "P"]
    assert list(two_copies["layers"]) == [f"layers.{i}" for i in range(6)]
    assert [v["mode"] for v in two_copies["layers"].values()] == (
        ["int8_per_token_head"] + ["none"] * 4 + ["tc4_per_token_head"]
    )
    assert all(v["cache_equal"] for v in two_copies["layers"].values())
    assert two_copies["prefill_logits_equal"] == [True, True, True]
    assert two_copies["first_differing_position"] == [None, None, None]
    calls = two_copies["calls"]
    assert [c["layer"] for c in calls] == [f"layers.{i}" for i in range(6)]  # one prefill each
    for c in calls:
        assert c["q_equal"] and c["out_equal"] and c["tables_equal"] and c["pages_equal"]
        assert c["rerun_equal"] == [True, True] and c["zero_ws_equal"] is None
    assert [c["scales_equal"] for c in calls] == [True] * 6


def _call(out: torch.Tensor, pages: torch.Tensor) -> dict:
    tables = [torch.tensor([0, 3]), torch.tensor([0, 1]), torch.tensor([4]), torch.tensor([3])]
    return {
        "layer": "layers.1", "key": None, "q": torch.zeros(3, 2, 4), "out": out,
        "rerun_equal": True, "zero_ws_equal": None, "tables": tables, "pages": pages,
        "scales": None,
    }  # fmt: skip


def test_compare_calls_says_which_rows_and_slots_differ() -> None:
    out, pages = torch.zeros(3, 2, 4), torch.zeros(1, 2, 16, 2, 8, dtype=torch.uint8)
    out2, pages2 = out.clone(), pages.clone()
    out2[2, 1, 3] = 1.0
    pages2[0, 1, 5, 0, 0] = 7  # v, slot 5: past the 3 tokens of the sequence's last page
    (row,) = compare_calls([_call(out, pages)], [_call(out2, pages2)])
    assert row["q_equal"] and row["tables_equal"] and not row["out_equal"]
    assert row["out_rows_differ"] == [1, [2]]
    assert not row["pages_equal"] and row["pages_differ_at"] == [[0, 1, 5]]
    assert row["last_page_len"] == [3]
    assert compare_calls([_call(out, pages)], [])[-1] == {"calls": [1, 0]}
