"""Tensor parallelism on 2 CPU processes (gloo), launched by the tests themselves (torchrun).

Each rank builds the model whole (the single-process reference) and as its shard from the same
seed, in fp32 with an FP8 KV cache and a skip rule: the shard's logits equal the whole model's
(<= 1e-5) for our Llama- and Gemma-3-style decoders (also with fused projections) and for
``KVQCausalLM`` on tiny transformers Llama / Gemma 3; compiled with the kvq passes equals eager;
every rank's pass report fuses the same layers, exactly the quantized ones. Ranks with another
config or a refused batch raise on every rank (no hang). Per-layer mode maps (fp8 per tensor,
int8 / fp8 per (token, head), issue 33's int4, k8v4 and tc4) shard their per-(token, head) scales
(tc4: side rows and K bases) and codes with their kv heads. ``tp_worker.py`` is the rank's side (``code_flips.py``: its cache
reading).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.support.launch import launch, run_bounded
from torch_kvq.distributed import (
    TensorParallel,
    compare_tables,
    full_shape,
    rank_table,
    shard_specs,
    shard_tensor,
)
from torch_kvq.models import build_model
from torch_kvq.spec import KVCacheConfig

WORKER = Path(__file__).with_name("tp_worker.py")
TOL = 1e-5  # fp32: the shards sum o_proj / down_proj in two parts, then all-reduce


def check_parity(ranks: list[dict], cases: tuple[str, ...]) -> None:
    r0, r1 = ranks
    assert set(cases) <= set(r0)
    for case in cases:
        row = r0[case]
        assert row["max_diff"] <= TOL, (case, row["max_diff"])
        assert row["same_tokens"], case
        assert row["compiled_diff"] <= TOL, (case, row["inner"], row["compiled_diff"])
        assert row.get("fused_diff", 0.0) <= TOL, (case, row.get("fused_diff"))
        # each rank holds half the query and KV heads in its spec and its cache
        [(qh, kh)] = row["global_heads"]
        assert row["local_heads"] == [[qh // 2, kh // 2]], case
        assert row["cache_shape"][3] == kh // 2, case
        # the skip rule kept some layers and quantized others, on both ranks alike
        assert row["kept"] and row["quantized"], case
        assert (row["kept"], row["quantized"]) == (r1[case]["kept"], r1[case]["quantized"])
        # every rank's pass report fuses the same layers: exactly the quantized ones
        rep = row["report"]
        assert rep == r1[case]["report"], case
        assert rep["quant+write"] == rep["dequant+attn"] == row["quantized"], case
        assert set(rep["layers"]) == set(row["kept"]) | set(row["quantized"]), case
        assert r1[case]["max_diff"] <= TOL and r1[case]["compiled_diff"] <= TOL, case


@pytest.mark.distributed
def test_tp2_matches_single_process(tmp_path):
    """Our decoders and HF models in one launch (one torch / transformers start-up per rank)."""
    ranks = launch("parity", tmp_path, timeout=300)
    check_parity(ranks, ("own:llama-tiny", "own:gemma3-tiny", "hf:llama", "hf:gemma3"))
    assert ranks[0]["own:llama-tiny"]["inner"] == "inductor"


FLIP_NOISE = 1e-5  # fp32 noise of a pre-quantization value, relative to the format's QMAX
FLIP_RATE = 1e-3  # at most this share of the quantized values written may flip


def check_code_flips(name: str, ranks: list[dict], pair: str) -> tuple[int | None, float]:
    """The codes that differ between two runs (``pair``: "single/shard" or "shard/compiled"), on
    all ranks: each is a rounding-boundary flip. Returns the first execution row with a flip
    (None: every code equal) and the flips' summed step (real units)."""
    flips = [f for r in ranks for f in r[name]["flips"] if f["pair"] == pair]
    values = sum(r[name]["values"] for r in ranks)
    assert len(flips) <= FLIP_RATE * values, (name, pair, len(flips), values, flips[:4])
    first = min((f["row"] for f in flips), default=None)
    for f in flips:
        m, (ya, yb) = f["boundary"], f["y"]
        # one code step apart, on either side of the rounding boundary between them
        assert f["adjacent"], (name, pair, f)
        if yb is not None:
            assert (ya - m) * (yb - m) <= 0, (name, pair, f)
        if f["row"] == first:  # the first flip: both values at the boundary, to fp32 noise
            for y in (ya, yb):
                assert y is None or abs(y - m) <= FLIP_NOISE * f["qmax"], (name, pair, f)
    return first, sum(f["step"] for f in flips)


def check_modes(ranks: list[dict]) -> None:
    """The per-layer mode maps of ``tp_worker.py modes`` / ``modes4`` on both ranks: the shard
    equals the whole model up to fp32 rounding, with one allowance, a code flip at a rounding
    boundary (``test_tp2_three_modes_at_once`` says why and how it is bounded); the scales shard
    with their kv heads; both ranks' pass reports fuse exactly the quantized layers."""
    r0, r1 = ranks
    for name, row in r0.items():
        if name == "ok":
            continue
        first, steps = check_code_flips(name, ranks, "single/shard")
        first_c, steps_c = check_code_flips(name, ranks, "shard/compiled")
        for r in ranks:
            res = r[name]
            assert res["max_diff"] <= TOL + steps, (name, res["max_diff"], steps)
            assert res["compiled_diff"] <= TOL + steps_c, (name, res["compiled_diff"], steps_c)
            for i, lay in enumerate(res["rows"]):
                before = first is None or i < first
                assert lay["in_diff"] <= (TOL if first is None or i <= first else TOL + steps), (
                    name, i, lay,
                )  # fmt: skip
                assert lay["out_diff"] <= (TOL if before else TOL + steps), (name, i, lay)
                if first is None or i <= first:
                    assert lay.get("scale_rel", 0.0) <= TOL, (name, i, lay)
                    assert lay.get("zp_diffs", 0) == 0, (name, i, lay)  # int4's zero points
        assert row["modes"] == r1[name]["modes"], name
        kh = row["global_kv_heads"] // 2
        for mode, shape in zip(row["modes"], row["scale_shapes"]):
            assert (shape is None) == (not mode.endswith("per_token_head")), (name, mode)
            assert shape is None or shape[2] == kh, (name, shape)  # [pages, 2, KH / 2, page]
        assert row["scales_written"] and r1[name]["scales_written"], name
        rep = row["report"]
        assert rep == r1[name]["report"], name
        quantized = sorted(
            lay for lay, m in zip(sorted(rep["layers"]), row["modes"]) if m != "none"
        )
        assert rep["quant+write"] == rep["dequant+attn"] == quantized, name


@pytest.mark.distributed
def test_tp2_three_modes_at_once(tmp_path):
    """Per-layer modes under tensor parallelism: the per-(token, head) scales shard with their kv
    heads (each rank's kv_scale holds its heads' scales), and the shard equals the whole model up
    to fp32 rounding, with one allowance: a code flip at a rounding boundary.

    The shard sums o_proj / down_proj in two parts and all-reduces them, so from layer 1 on its
    k / v differ from the whole model's by fp32 noise (~1e-6). A value whose ``x / scale`` lies
    that close to a rounding boundary (int8: n + 0.5; e4m3: the midpoint of two neighbours) gets
    the neighbouring code on one side. Measured on Gemma-3-tiny (torch 2.13 CPU, this reference
    attention): every code and scale equal, every layer's inputs and outputs within 3.3e-6, up to
    rank 1's decode step at layer 2 (int8 per (token, head)), where v of kv head 1, dim 31, of
    the first sequence's token is -119.49996 code units in the whole model and exactly -119.5 in
    the shard: code -119 vs -120 (half away from zero), one step of 0.0121. That layer's output
    moves by 8.8e-4 (the token's attention weight times the step), the later layers' inputs by
    <= 2.6e-4 on both ranks (the all-reduce carries it), the logits by 1.6e-4 (eager and compiled
    alike: the compiled shard rounds that value to -119, as the whole model does). Which value
    lands on a boundary follows the roundings of the whole path: with torch SDPA as the reference
    attention (h32-core) no code flipped and the logits agreed to 3e-6; Llama-tiny has no flip
    (logits within 2.4e-6). No choice in the reference kernel can make shard and whole
    bit-identical: the o_proj / down_proj partial sums differ before any attention.

    So the comparison, on both ranks: (1) every cache code equal, except rounding-boundary flips:
    adjacent codes, the two pre-quantization values on either side of the boundary between them,
    and for the first flip both within fp32 noise of it (1e-5 x QMAX code units), at most 1 in
    1000 values; (2) until the first flip, every layer's q / k / v and output and every
    per-(token, head) scale within 1e-5 (relative for scales), as before; (3) from there on, and
    for the logits, within 1e-5 plus the flips' summed step (one step per flipped code, at its
    layer's scale: a v flip moves the output by the token's weight times the step, at most one
    step; asserted, not assumed, for what the later layers make of it). With no flip, (3) is the
    old 1e-5. The compiled shard is held to the same against the eager shard (codes compared slot
    by slot, the eager values at the boundary)."""
    ranks = launch("modes", tmp_path, timeout=300)
    check_modes(ranks)
    for name, row in ranks[0].items():
        assert name == "ok" or len(set(row["modes"])) >= 3, (name, row["modes"])


# each 4-bit case's modes, layer by layer (tp_worker.MAPS_4BIT); "none": the model dtype (fp32)
INT4, K8V4, INT8 = "int4_per_token_head", "k8v4_per_token_head", "int8_per_token_head"
MODES_4BIT = {
    "llama-tiny:int4": [INT4] * 4,
    "llama-tiny:k8v4": [K8V4] * 4,
    "llama-tiny:mixed": [INT4, K8V4, INT8, "none"],
    "gemma3-tiny:mixed": [INT8, "none", K8V4, INT4, INT4, K8V4],  # layers 2, 5: full attention
    "llama-tiny:int4-channels": [INT4] * 4,  # layers 0, 2 with K channel scales
}
# per mode: (cache dtype, dim 1 (slots), last dim at head size 32)
CACHE_4BIT = {INT4: ("torch.uint8", 2, 16), K8V4: ("torch.uint8", 3, 16),
              INT8: ("torch.int8", 2, 32), "none": ("torch.float32", 2, 32)}  # fmt: skip


@pytest.mark.distributed
def test_tp2_four_bit_modes(tmp_path):
    """Issue 33's modes under tensor parallelism: ``int4_per_token_head`` alone,
    ``k8v4_per_token_head`` alone, and maps mixing them with int8 per (token, head) and
    unquantized layers (Llama- and Gemma-3-style, 2 kv heads of 32). The same comparison as the
    8-bit modes' (``check_modes``): every cache code of the shard (int4's unpacked nibbles, k8v4's
    k from its two slots) equal to the whole model's on the rank's kv heads but for
    rounding-boundary flips, every scale within 1e-5 and every int4 zero point equal before the
    first flip, logits within 1e-5 plus the flips' steps, compiled == eager the same way. A row
    whose MSE clip ratio differed between the two runs would show as non-adjacent codes and a
    scale off by more than 1e-5: it fails. Measured (torch 2.13 CPU): no code flipped in any
    case, logits within 3e-6. Each rank's cache holds its one kv head: int4 uint8 [pages, 2,
    page, 1, D / 2], k8v4 uint8 [pages, 3, page, 1, D / 2]; with K channel scales, their
    [1, D] row."""
    ranks = launch("modes4", tmp_path, timeout=300)
    check_modes(ranks)
    assert set(ranks[0]) - {"ok"} == set(MODES_4BIT)
    for r in ranks:
        for name, modes in MODES_4BIT.items():
            row = r[name]
            assert row["modes"] == modes, (name, row["modes"])
            assert row["global_kv_heads"] == 2, name
            for mode, shape, dtype in zip(modes, row["cache_shapes"], row["cache_dtypes"]):
                want_dtype, slots, code_dim = CACHE_4BIT[mode]
                assert (dtype, shape[1], shape[3], shape[4]) == (want_dtype, slots, 1, code_dim), (
                    name, mode, shape, dtype,
                )  # fmt: skip
            assert row["values"] > 0, name  # k / v values written by its quantized layers
            # K channel scales: each rank holds its one kv head's row
            want = [[1, 32], None, [1, 32], None] if name.endswith("channels") else [None] * 4
            assert row["k_channel_shapes"][:4] == want, (name, row["k_channel_shapes"])


TC4 = "tc4_per_token_head"


@pytest.mark.distributed
def test_tp2_tc4_layers(tmp_path):
    """``tc4_per_token_head`` under tensor parallelism (``tp_worker.tc4``): each rank's tc4 layers
    hold their one kv head's code rows [pages, 2, page, 1, D / 2], aux blocks [pages, 1, 18, page]
    and basis (the whole model's row for that head); the rows a rank wrote equal the whole
    model's on its head (at most 2 bytes apart a layer: a value computed apart in its last bits
    on a rounding boundary), the logits within 1e-5, compiled equal to eager, and both ranks fuse
    the same layers, tc4's and int4's writes and reads. Measured (torch 2.13 CPU): no byte apart,
    logits within 2.6e-6."""
    ranks = launch("tc4", tmp_path, timeout=300)
    for r in ranks:
        assert r["ok"], r.get("traceback")
        row = r["tc4"]
        assert row["modes"] == [TC4, INT4, TC4, "none"], row["modes"]
        assert row["max_diff"] <= TOL and row["compiled_diff"] <= TOL, row
        for lay in row["layers"]:
            assert lay["cache_shape"][1:] == [2, 4, 1, 16] and lay["side_shape"][1:] == [1, 18, 4]
            assert lay["basis_equal"] and lay["slots_written"] > 0, lay
            assert lay["code_bytes_apart"] + lay["side_bytes_apart"] <= 2, lay
            assert lay["compiled_bytes_apart"] == 0, lay
        rep = row["report"]
        assert rep == ranks[1]["tc4"]["report"]
        assert rep["quant+write"] == rep["dequant+attn"] and len(rep["quant+write"]) == 3, rep


@pytest.mark.distributed
def test_ranks_refuse_together(tmp_path):
    r0, r1 = launch("agreement", tmp_path, timeout=180)
    for res in (r0, r1):  # another skip rule / scale on rank 1: both ranks raise, naming it
        assert res["skip_mismatch"]["type"] == "ValueError"
        assert (
            "mm.layers.1.self_attn.attn' mode: rank 0 has 'fp8_per_tensor', rank 1 has 'none'"
            in res["skip_mismatch"]["message"]
        )
        assert res["scale_mismatch"]["type"] == "ValueError"
        assert "v_scale: rank 0 has 0.05, rank 1 has 0.07" in res["scale_mismatch"]["message"]
        assert res["different_batch"]["type"] == "ValueError"
        assert "disagree on the generate call" in res["different_batch"]["message"]
    # rank 1 runs out of pages / gets a bad prompt: it raises its error, rank 0 refuses too
    assert r1["out_of_pages"]["type"] == "OutOfPagesError"
    assert r0["out_of_pages"]["type"] == "RankRefusedError"
    assert "rank 1 refused the batch (OutOfPagesError" in r0["out_of_pages"]["message"]
    assert r1["bad_prompt"]["type"] == "ValueError"
    assert r0["bad_prompt"]["type"] == "RankRefusedError"
    assert "999999" in r0["bad_prompt"]["message"]
    # calibration: the same scales on every rank, those of the whole model in one process
    # (equal up to fp32 rounding: the shards add o_proj / down_proj partial sums in another order)
    assert r0["scales"] == r1["scales"] and len(r0["scales"]) == 4
    for name, pair in r0["scales_whole"].items():
        assert r0["scales"][name] == pytest.approx(pair, rel=1e-5), name
    # afterwards both ranks still run in step, and every page came back
    assert r0["after"] == r1["after"] and r0["after"]["free_pages"] == 8


@pytest.mark.distributed
def test_cli_demo_tp2_starts_its_ranks(tmp_path):
    """``kvq demo --tp 2`` re-runs itself under torchrun; rank 0 prints, both ranks run."""
    cmd = [sys.executable, "-m", "torch_kvq.cli", "demo", "--preset", "gemma3-tiny", "--tp", "2", "--compile", "off",
           "--layers", "3", "--max-new-tokens", "2"]  # fmt: skip
    out = run_bounded(cmd, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:]
    assert "tensor-parallel over 2 ranks" in out.stdout
    assert out.stdout.count("next-token agreement") == 1  # rank 1 stays quiet


# --- in-process (no process group) ---------------------------------------------------------------


def test_shards_cover_the_full_weights():
    tps = [TensorParallel(r, 2) for r in (0, 1)]
    full = torch.arange(24.0).reshape(4, 6)
    for name, dim in (
        ("layers.0.self_attn.k_proj.weight", 0),
        ("layers.0.mlp.down_proj.weight", 1),
    ):
        parts = [shard_tensor(name, full, tp) for tp in tps]
        assert torch.equal(torch.cat(parts, dim), full)
        assert full_shape(name, parts[0].shape, tps[0]) == (4, 6)
    assert shard_tensor("layers.0.mlp.down_proj.bias", full, tps[1]) is full  # added once
    assert shard_tensor("embed_tokens.weight", full, tps[1]) is full  # replicated


def test_spec_tables_agree_but_for_heads():
    kv = KVCacheConfig("fp8", skip_layers=(0,))
    tp = TensorParallel(0, 2)
    model = build_model("llama-tiny", kv, prefix="tbl")
    local = shard_specs(model.kv_specs, tp)
    assert [(s.num_heads, s.num_kv_heads) for s in local] == [(2, 1)] * 4
    assert [s.mode for s in local] == [s.mode for s in model.kv_specs]
    table = rank_table(model.kv_specs, model.kernel)
    compare_tables([table, dict(table)])  # equal: no error
    other = {**table, "layer 'tbl.layers.2.self_attn.attn' k_scale": 0.5}
    with pytest.raises(ValueError, match="k_scale: rank 0 has 1.0, rank 1 has 0.5"):
        compare_tables([table, other])
