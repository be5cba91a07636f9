"""The ``kvq`` command: wiring, ``kvq demo`` output, and clean errors for bad arguments."""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path

import pytest

from tests.support.cli import run_main
from torch_kvq import cli
from torch_kvq.cli import args as cli_args


def test_demo_tiny_gemma_fp8_with_sliding_layers_kept(capsys, monkeypatch):
    monkeypatch.setenv("TORCH_KVQ_PROGRESS", "1")  # progress as on a terminal
    monkeypatch.setenv("COLUMNS", "300")  # a wide one: lines are cut to the terminal's width
    code, out, err = run_main(capsys, "demo", "--preset", "gemma3-tiny", "--max-new-tokens", "3")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if re.match(r"^\d+\s+model", line)]
    assert len(rows) == 6
    for row in rows:  # idx layer type mode dtype ...
        kept = row[2].startswith("sliding")
        assert row[3:5] == (["none", "bfloat16"] if kept else ["fp8_per_tensor", "float8_e4m3fn"])
    m = re.search(
        r"max \|logit diff\| vs the all-bfloat16 cache: prefill ([\d.]+), decode ([\d.]+)", out
    )
    assert m, out
    assert 0.0 < float(m[1]) < 0.5 and 0.0 < float(m[2]) < 0.5
    assert "next-token agreement" in out and out.count("bf16 greedy") == 3
    # the default compiles with the kvq passes, shows progress and timings
    assert "compile kvq-eager" in out and "fused quant+write" in out
    assert "[########################] 3/3 steps" in err and "all-bfloat16 cache, eager" in err
    assert "prefill (the first call traces and compiles) > compiling: kvq passes" in err
    assert re.search(
        r"timings: all-bfloat16 cache eager [\d.]+ s; quantized \(kvq-eager\) [\d.]+ s", out
    )
    # a newcomer reads why the generations repeat and what the CPU timings are not
    assert "The weights are random" in out and "say nothing about speed on a GPU" in out
    assert "then 1 decode step at" in out  # 3 new tokens: prefill, first decode, then one
    # it fits a 100-column terminal: what fused is a summary under the table (--wide: columns)
    assert max(len(line) for line in out.splitlines()) <= 100, out
    assert "k_scale" not in out and "fuse_quant_cache_write" not in out
    assert "fused:\n  nothing: layers 0, 1, 3, 4\n  quant+write, dequant+attn: layers 2, 5" in out


def test_demo_llama_with_repeated_skips(capsys):
    code, out, err = run_main(
        capsys,
        "demo",
        "--preset",
        "llama-tiny",
        "--skip",
        "0",
        "--skip=-1",
        "--max-new-tokens",
        "1",
        "--compile",
        "off",
    )
    assert code == 0, err
    modes = [line.split()[3] for line in out.splitlines() if re.match(r"^\d+\s+model", line)]
    assert modes == ["none", "fp8_per_tensor", "fp8_per_tensor", "none"]


def test_demo_auto_dtype_matches_bf16_exactly(capsys):
    code, out, _ = run_main(
        capsys,
        "demo",
        "--preset",
        "gemma3-tiny",
        "--kv-cache-dtype",
        "auto",
        "--max-new-tokens",
        "2",
        "--compile",
        "off",
    )
    assert code == 0
    assert "prefill 0.0000, decode 0.0000" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["demo", "--preset", "gemma3-tiny", "--skip", "99"],
            "skip_layers index 99 is out of range",
        ),
        (["demo", "--preset", "gemma3-tiny", "--skip", "nope"], "unknown skip rule 'nope'"),
        (
            ["demo", "--preset", "gemma3-tiny", "--kv-cache-dtype", "int4"],
            "unknown kv_cache_dtype 'int4'",
        ),
    ],
)
def test_bad_values_exit_2_with_the_reason(capsys, argv, message):
    code, out, err = run_main(capsys, *argv)
    assert code == 2
    assert err.startswith("kvq demo: error:") and message in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "required: COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["demo", "--preset", "gpt"], "invalid choice: 'gpt'"),
        (["demo", "--max-new-tokens", "0"], "expected a positive int, got '0'"),
        (["demo", "--compile", "inductor"], "invalid choice: 'inductor'"),
        (
            ["demo", "--preset", "gemma3-tiny", "--skip", "0", "--no-skip"],
            "not allowed with argument",
        ),
        (["demo", "--tp", "0"], "expected a positive int, got '0'"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    code, _, err = run_main(capsys, *argv)
    assert code == 2 and message in err, err


def test_demo_compiled_with_the_kvq_passes(capsys):
    """--compile kvq-eager: the kvq passes on the post-grad graph, no Inductor codegen."""
    gc.collect()  # models other tests left for the collector still hold the names "model.*"
    argv = (
        "demo",
        "--preset",
        "gemma3-tiny",
        "--compile",
        "kvq-eager",
        "--max-new-tokens",
        "1",
        "--wide",
    )
    code, out, err = run_main(capsys, *argv)
    assert code == 0, err
    assert re.search(r"k_scale +v_scale +cache KiB", out)  # --wide: every column of the spec table
    rows = [line for line in out.splitlines() if line.startswith("model.")]  # the pass report
    fused = [line for line in rows if "fused quant+write" in line and "fused dequant+attn" in line]
    kept = [line for line in rows if line.split()[1] == "none" and "kept bf16" in line]
    assert [line.split()[0] for line in fused] == [
        f"model.layers.{i}.self_attn.attn" for i in (2, 5)
    ]
    assert len(kept) == 4, out
    m = re.search(r"prefill ([\d.]+), decode n/a", out)
    assert m and 0.0 < float(m[1]) < 0.5, out


def test_compile_kvq_without_backend_is_a_clean_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_kvq.passes", None)  # import of it now fails
    code, _, err = run_main(
        capsys, "demo", "--preset", "gemma3-tiny", "--compile", "kvq", "--max-new-tokens", "1"
    )
    assert code == 2
    assert "--compile kvq needs torch_kvq.passes.kvq_backend" in err, err


def test_console_script_points_at_main():
    """pyproject's ``kvq`` script is ``torch_kvq.cli:main`` (checked without a subprocess)."""
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert re.search(r'^kvq = "torch_kvq\.cli:main"$', text, re.M)
    assert callable(cli.main)


@pytest.mark.parametrize("arch", ["h200", "sm75", "SM90"])
def test_inspect_refuses_an_unknown_arch(capsys, arch):
    code, out, err = run_main(capsys, "inspect", "--arch", arch)
    assert code == 2 and not out
    assert f"kvq inspect: error: unknown arch '{arch}'; expected one of ['cpu', 'sm80'," in err, err
    assert "'sm90'" in err


def test_inspect_shows_layers_the_kernel_cannot_serve_and_fails(capsys):
    """The presets' head size 32 is not one FlashInfer serves: every layer is shown NOT SERVED
    (the default kernel for sm90, said so) and the command exits 2 naming the reason."""
    code, out, err = run_main(capsys, "inspect", "--arch", "sm90")
    assert code == 2
    assert "kernel flashinfer on sm90 (the default shown; compiles never pick one" in out
    assert (
        "  NOT SERVED: head size 32 is not supported; expected one of (64, 128, 256): every " in out
    )
    assert "kernel 'flashinfer' on sm90 cannot serve 6 of 6 layers" in err, err
    assert "expected one of (64, 128, 256)" in err
    code, out, _ = run_main(capsys, "inspect", "--arch", "sm90", "--wide")  # one row per layer
    not_served = [line for line in out.splitlines() if "NOT SERVED: head size 32" in line]
    assert code == 2 and len(not_served) == 6, out


def test_inspect_head_dim_and_a_partly_served_model(capsys):
    code, out, err = run_main(capsys, "inspect", "--arch", "sm90", "--head-dim", "128")
    assert code == 0, err
    assert "NOT SERVED" not in out and "quant+write, dequant+attention" in out
    # XQA on sm86: the bf16 (sliding) layers are served, the FP8 ones are not
    code, out, err = run_main(
        capsys, "inspect", "--arch", "sm86", "--kernel", "flashinfer-xqa", "--head-dim", "128"
    )
    assert code == 2
    (line,) = [x for x in out.splitlines() if "NOT SERVED: quant mode 'fp8_per_tensor'" in x]
    assert line.endswith(": layers 2, 5"), out
    assert "cannot serve 2 of 6 layers" in err
    code, _, err = run_main(capsys, "inspect", "--head-dim", "0")
    assert code == 2 and "--head-dim must be a positive int, got 0" in err


def test_inspect_fits_100_columns_and_wide_shows_every_column(capsys):
    code, out, err = run_main(capsys, "inspect")
    assert code == 0, err
    assert max(len(line) for line in out.splitlines()) <= 100, out
    header = next(line for line in out.splitlines() if line.startswith("idx"))
    assert header.split() == ["idx", "layer", "type", "mode", "cache", "dtype", "bytes/token"]
    assert (
        "will fuse:\n  kept bf16 (skipped: skip rule 'sliding_window'): layers 0, 1, 3, 4\n" in out
    )
    assert "  quant+write, dequant+attention: layers 2, 5\n" in out
    code, out, err = run_main(capsys, "inspect", "--wide")
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("idx"))
    assert "k_scale" in header and "output quant" in header and "will fuse" in header
    assert "will fuse:" not in out


def test_a_type_rule_matching_no_layer_is_reported(capsys):
    """The default skip rule 'sliding_window' on a model without sliding windows quantizes every
    layer: not an error (one config serves several models), but said under the table."""
    note = (
        "note: skip rule 'sliding_window' matches no layer (this model has no sliding-window "
        "layers): every layer is quantized"
    )
    code, out, err = run_main(capsys, "inspect", "--preset", "llama-tiny")
    assert code == 0 and note in " ".join(out.split()), out + err  # wrapped at 100 columns
    assert max(len(line) for line in out.splitlines()) <= 100, out
    code, out, err = run_main(capsys, "inspect", "--preset", "llama-tiny", "--wide")
    assert code == 0 and note in out.splitlines(), out + err  # the spec table's own line
    code, out, err = run_main(capsys, "inspect", "--preset", "llama-tiny", "--json")
    assert code == 0 and len(json.loads(out)) == 4
    assert f"kvq inspect: {note}" in err
    argv = ("demo", "--preset", "llama-tiny", "--max-new-tokens", "1", "--compile", "off")
    code, out, err = run_main(capsys, *argv)
    assert code == 0 and note in " ".join(out.split()), out + err
    assert max(len(line) for line in out.splitlines()) <= 100, out
    code, out, _ = run_main(capsys, "inspect")  # Gemma: the rule splits the layers, no note
    assert code == 0 and "note: skip rule" not in out


# ``kvq --help`` must stay fast: no torch (6-9 s to import) until a subcommand runs.
_NO_TORCH = """
import sys, argparse, importlib
import torch_kvq.cli as c
from torch_kvq.cli.args import SUBCOMMANDS
c.build_parser(load=[]).format_help()  # what ``kvq --help`` builds
for name in SUBCOMMANDS:  # their parsers (``kvq <sub> --help``)
    sub = argparse.ArgumentParser().add_subparsers()
    importlib.import_module(SUBCOMMANDS[name][0]).add_parser(sub)
    sub.choices[name].format_help()
c.build_parser().format_help()  # every parser, with the model source group
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
"""


def test_help_imports_no_torch():
    import subprocess

    r = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_help_lists_every_subcommand_without_loading_it(capsys):
    code, out, _ = run_main(capsys, "--help")
    assert code == 0
    for name, (_, help_line) in cli_args.SUBCOMMANDS.items():
        assert name in out and help_line.split()[0] in out


def test_torch_free_copies_match_the_originals():
    import argparse

    from torch_kvq.cli import accuracy as accuracy_cmd
    from torch_kvq.debug import accuracy
    from torch_kvq.models import PRESETS
    from torch_kvq.spec import SUPPORTED_PAGE_SIZES

    assert cli_args.PRESET_NAMES == tuple(sorted(PRESETS))
    assert cli_args.DEFAULT_PRESET in PRESETS
    assert cli_args.PAGE_SIZES == tuple(SUPPORTED_PAGE_SIZES)
    assert accuracy_cmd.DEFAULT_THRESHOLD_DB == accuracy.DEFAULT_THRESHOLD_DB
    from torch_kvq.evaluation import sensitivity
    from torch_kvq.integrations.trained_sources import SHIPPED

    assert accuracy_cmd.DEFAULT_THRESHOLD_PCT == sensitivity.DEFAULT_THRESHOLD_PCT
    assert cli_args.SHIPPED_MODELS == tuple(sorted(SHIPPED))
    from dataclasses import asdict

    from torch_kvq.cli import eval as eval_cmd
    from torch_kvq.evaluation.eval import EvalSettings

    assert eval_cmd.SETTINGS == asdict(EvalSettings())
    parser = cli.build_parser()  # every subcommand's full parser
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {a.dest: a.help for a in sub._choices_actions}
    assert helps == {name: help_line for name, (_, help_line) in cli_args.SUBCOMMANDS.items()}


def test_lazy_package_names():
    import torch_kvq

    assert torch_kvq.KVCacheConfig.__name__ == "KVCacheConfig"
    assert callable(torch_kvq.kvq_backend)
    assert set(torch_kvq.__all__) <= set(dir(torch_kvq))
    with pytest.raises(AttributeError):
        torch_kvq.no_such_name  # noqa: B018


def test_demo_default_is_gemma3_270m_in_english(capsys):
    """``kvq demo`` with no model: the trained Gemma-3-270M, sliding layers bf16 and globals FP8,
    English continuations side by side, the plan and the uncalibrated-scale note."""
    code, out, err = run_main(capsys, "demo", "--max-new-tokens", "4")
    assert code == 0, err
    assert out.startswith("kvq demo: trained model gemma3-270m, compile off")
    rows = [line.split() for line in out.splitlines() if re.match(r"^\d+\s+model\.layers", line)]
    assert len(rows) == 18
    for row in rows:  # idx layer type mode dtype ...
        kept = row[2].startswith("sliding")
        assert row[3:5] == (["none", "bfloat16"] if kept else ["fp8_per_tensor", "float8_e4m3fn"])
    assert [int(r[0]) for r in rows if not r[2].startswith("sliding")] == [5, 11, 17]
    assert "quant+write, dequant+attention: layers 5, 11, 17" in out
    assert "note: scale 1.0, uncalibrated: every quantized layer" in out
    assert out.count("prompt ") == 3 and "'The history of the city begins'" in out
    texts = re.findall(r"^  (?:all-bfloat16 cache|quantized cache):\s+\.\.\.(.*)$", out, re.M)
    assert len(texts) == 6 and all(re.search(r"[a-z]{3,} [a-z]{2,}", t) for t in texts), out
    assert len(re.findall(r"fed the other's tokens: \d+ of 4 agree\)", out)) == 3, out
    assert max(len(line) for line in out.splitlines()) <= 100, out


@pytest.mark.parametrize(
    "text, modes",
    [
        ("0-2:fp8", ((0, "fp8"), (1, "fp8"), (2, "fp8"))),
        ("-1:int8_per_token_head, sliding_window:auto", ((-1, "int8_per_token_head"),
                                                         ("sliding_window", "auto"))),
        ("model.layers.1*:fp8_per_token_head", (("model.layers.1*", "fp8_per_token_head"),)),
    ],
)  # fmt: skip
def test_kv_map_parses_ranges_indices_and_rules(text, modes):
    assert cli_args.kv_map(text) == modes


def test_inspect_with_a_kv_map_shows_every_mode(capsys):
    """Three modes at once; with a map no layer is skipped by default (the map says it all)."""
    code, out, err = run_main(
        capsys, "inspect", "--kv-cache-dtype", "auto", "--wide",
        "--kv-map", "0:fp8,full_attention:int8_per_token_head,4:fp8_per_token_head",
    )  # fmt: skip
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if re.match(r"\d+\s+model\.", line)]
    assert [r[3] for r in rows] == [
        "fp8_per_tensor", "none", "int8_per_token_head", "none", "fp8_per_token_head",
        "int8_per_token_head",
    ]  # fmt: skip
    assert "layer_modes=((0, 'fp8'), ('full_attention', 'int8_per_token_head')" in out
    code, _, err = run_main(capsys, "inspect", "--kv-map", "0-3")
    assert code == 2 and "argument --kv-map: map entry '0-3' is not RULE:MODE" in err


FOUR_BIT_MAP = "0:int4_per_token_head,1:k8v4_per_token_head,2:int8_per_token_head"


def test_inspect_a_map_with_four_bit_layers_counts_their_bytes(capsys):
    """llama-tiny at head 128 (2 kv heads): per token, int4 2 x 2 x (64 + 4) = 272 bytes, k8v4
    2 x (128 + 64 + 8) = 400, int8 2 x 2 x (128 + 4) = 528, bf16 2 x 2 x 256 = 1024; the table,
    the total and --json agree, and the reference kernel fuses every quantized layer."""
    argv = ("inspect", "--preset", "llama-tiny", "--head-dim", "128", "--kv-cache-dtype", "auto",
            "--kv-map", FOUR_BIT_MAP)  # fmt: skip
    code, out, err = run_main(capsys, *argv, "--wide")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if re.match(r"\d+\s+\S+\.layers\.", line)]
    # idx layer type mode cache-dtype bytes/token scale-bytes/token ...
    assert [r[3:7] for r in rows] == [
        ["int4_per_token_head", "uint8", "272", "16"],
        ["k8v4_per_token_head", "uint8", "400", "16"],
        ["int8_per_token_head", "int8", "528", "16"],
        ["none", "bfloat16", "1024", "0"],
    ]
    assert [line.endswith("quant+write, dequant+attention") for line in out.splitlines()
            if re.match(r"\d+\s+\S+\.layers\.", line)] == [True, True, True, False]  # fmt: skip
    assert (
        "3 of 4 layers quantized; KV bytes per token (all layers): 2224 (all-bfloat16: 4096)" in out
    )
    code, out, err = run_main(capsys, *argv, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert [(r["mode"], r["storage_dtype"], r["cache_bytes_per_token"]) for r in plan] == [
        ("int4_per_token_head", "torch.uint8", 272), ("k8v4_per_token_head", "torch.uint8", 400),
        ("int8_per_token_head", "torch.int8", 528), ("none", "torch.bfloat16", 1024),
    ]  # fmt: skip


def test_inspect_a_tc4_map_with_k_bases_from_a_file(capsys, tmp_path):
    """--k-bases gives a transformers model's tc4 layers their bases (a kvq calibrate file, here
    written by calibrate.write_scales with identity bases): the table shows their bytes (2 kv
    heads of 16: 2 x (8 + 8 + 17) = 66, bf16 128) and the basis digest; without the file the
    config is refused, naming the option."""
    import torch

    from torch_kvq.evaluation.calibrate import write_scales
    from torch_kvq.spec_channels import KBasis

    out = tmp_path / "kv.safetensors"
    eye = KBasis.of(torch.eye(16).expand(2, 16, 16))
    paths = [f"model.layers.{i}.self_attn" for i in range(4)]
    write_scales({}, out, {}, k_bases={p: eye for p in paths})
    argv = ("inspect", "--hf", "llama", "--kv-cache-dtype", "auto", "--kv-map",
            "0:tc4_per_token_head,2:tc4_per_token_head", "--json")  # fmt: skip
    code, stdout, err = run_main(capsys, *argv, "--k-bases", str(out))
    assert code == 0, err
    plan = json.loads(stdout)
    assert [(r["mode"], r["cache_bytes_per_token"]) for r in plan][:3] == [
        ("tc4_per_token_head", 66), ("none", 128), ("tc4_per_token_head", 66)
    ]  # fmt: skip
    assert plan[0]["k_basis"] == eye.label and plan[1]["k_basis"] is None
    code, _, err = run_main(capsys, *argv)
    assert code == 2 and "--k-bases PATH" in err


def test_inspect_plans_int4_layers_on_flashinfer_sm90(capsys):
    """int4's sm90 rows: FlashInfer serves the layer (Triton decode, prefill on the scratch) and
    the passes fuse its write and read; elsewhere it is refused, naming the mode."""
    argv = ("inspect", "--preset", "llama-tiny", "--head-dim", "128", "--kv-cache-dtype", "auto",
            "--kv-map", "0-1:int4_per_token_head,2:int8_per_token_head", "--kernel", "flashinfer",
            "--json")  # fmt: skip
    code, out, err = run_main(capsys, *argv, "--arch", "sm90")
    assert code == 0, err
    plan = json.loads(out)
    assert [(r["mode"], r["not_served"], r["fuses"]) for r in plan[:3]] == [
        ("int4_per_token_head", None, "quant+write, dequant+attention")] * 2 + [
        ("int8_per_token_head", None, "quant+write, dequant+attention")]  # fmt: skip
    code, out, err = run_main(capsys, *argv, "--arch", "sm80")
    assert code == 2
    assert re.search(
        r"layer '\S+\.layers\.0\.self_attn\.attn': quant mode 'int4_per_token_head' is not", err
    )
