"""Shipped trained models: loading (through the converted cache), kv "auto" == HF eager, FP8 on a
short window, and the cache's failure handling."""

from __future__ import annotations

import json

import pytest
import torch

from torch_kvq.evaluation import corpus
from torch_kvq.evaluation.eval import teacher_forced_ppl
from torch_kvq.integrations import trained, trained_cache, trained_sources
from torch_kvq.integrations.transformers import KVQCausalLM
from torch_kvq.spec import KVCacheConfig

# FP8 (scale 1.0, every layer) against the model-dtype cache on two 128-token windows (ca01, cb01);
# measured +1.69% (SmolLM2) and +0.87% (Gemma-3) in fp32 (torch 2.13 CPU). The bound leaves room
# for other CPUs' rounding, not for a broken FP8 path (an unquantized read gives exactly 0, a
# wrong scale tens of percent).
FP8_SHORT_WINDOW_BOUND_PCT = 3.0


def _ids(tok, fid: str, n: int) -> list[int]:
    return tok(corpus.text(fid))["input_ids"][:n]


@torch.no_grad()
def test_auto_logits_equal_hf_eager(shipped):
    """In fp32, the paged cache with kv "auto" gives HF eager's logits exactly, for two sequences
    of different lengths in one flat batch."""
    name, hf, tok = shipped
    prompts = [_ids(tok, "ca01", 40), _ids(tok, "cb01", 56)]
    refs = [hf(input_ids=torch.tensor([p]), use_cache=False).logits[0].float() for p in prompts]
    lm = KVQCausalLM.from_hf(hf, KVCacheConfig(), num_pages=16)
    try:
        md = lm.allocator.build_batch([(i, len(p)) for i, p in enumerate(prompts)])
        with lm.forward_context(md):
            got = lm(torch.tensor(prompts[0] + prompts[1]), md.positions)
    finally:
        lm.detach()
    assert torch.equal(got[:40], refs[0]) and torch.equal(got[40:], refs[1]), name


@torch.no_grad()
def test_fp8_short_window_perplexity_within_bound(shipped):
    name, hf, tok = shipped
    windows = [_ids(tok, "ca01", 128), _ids(tok, "cb01", 128)]
    lm = KVQCausalLM.from_hf(hf, KVCacheConfig(), num_pages=16)
    try:
        ref = teacher_forced_ppl(lm, windows)
        lm.configure_kv(KVCacheConfig("fp8"))
        fp8 = teacher_forced_ppl(lm, windows)
    finally:
        lm.detach()
    delta = 100 * (fp8 / ref - 1)
    assert 1.0 < ref < 1000.0, (name, ref)  # real text, a trained model
    assert fp8 != ref and abs(delta) < FP8_SHORT_WINDOW_BOUND_PCT, (name, ref, fp8)


def test_shipped_cache_is_found_without_conversion(shipped, monkeypatch):
    """A shipped name's converted folder is found from its pinned sha256: no conversion, and the
    folder's marker lists the files with their sizes."""
    name = shipped[0]
    monkeypatch.setattr(trained_cache, "_convert", lambda *a: pytest.fail("converted again"))
    folder = trained_cache.converted_folder(name)
    marker = json.loads((folder / trained_cache.MARKER).read_text())
    assert marker["sha256"] == trained_sources.SHIPPED[name].sha256
    assert "model.safetensors" in marker["files"] and "tokenizer.json" in marker["files"]
    assert (
        trained.model_config(name).num_hidden_layers
        == {"smollm2-135m": 30, "gemma3-270m": 18}[name]
    )


def test_unknown_sources_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not a shipped model name .*gemma3-270m"):
        trained.load_hf("llama-7b")
    with pytest.raises(ValueError, match="has no config.json"):
        trained.load_hf(tmp_path)
    with pytest.raises(ValueError, match="dtype torch.int8 unsupported"):
        trained.load_hf("smollm2-135m", dtype=torch.int8)


def test_missing_packages_say_what_to_install(monkeypatch):
    real = trained_sources.importlib.util.find_spec
    monkeypatch.setattr(
        trained_sources.importlib.util,
        "find_spec",
        lambda m, *a: None if m == "gguf" else real(m, *a),
    )
    with pytest.raises(ImportError, match=r"needs gguf: pip install 'torch-kvq\[models\]'"):
        trained_sources._need("transformers", "gguf")


def _tiny_converter(tmp_path, shipped_folder, calls):
    """A stand-in for the GGUF conversion: save a tiny random Llama with SmolLM2's tokenizer."""
    from torch_kvq.integrations.hf_tiny import tiny_hf_model

    def convert(src, final):
        calls.append(final)
        model = tiny_hf_model("llama", torch.float32, 0)
        tok = __import__("transformers").AutoTokenizer.from_pretrained(str(shipped_folder))
        trained_cache._save(src, model, tok, final)

    return convert


def test_gguf_cache_is_built_once_and_rebuilt_when_damaged(tmp_path, monkeypatch):
    """A GGUF path converts into a folder keyed by its sha256 and size; the next load reuses it;
    a folder whose files do not match its marker, or that does not load, is rebuilt."""
    shipped_folder = trained_cache.converted_folder("smollm2-135m")  # for its tokenizer files
    monkeypatch.setenv("TORCH_KVQ_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not really a gguf")  # the stand-in converter never reads it
    calls: list = []
    monkeypatch.setattr(trained_cache, "_convert", _tiny_converter(tmp_path, shipped_folder, calls))
    model, tok = trained.load_hf(gguf)
    folder = calls[0]
    assert folder.name.startswith("gguf-") and folder.name.endswith(f"-{len(b'not really a gguf')}")
    trained.load_hf(gguf)
    assert len(calls) == 1  # reused
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated: the sizes no longer match
    trained.load_hf(gguf)
    assert len(calls) == 2
    (folder / "config.json").write_text("{not json")  # same size class of damage: load fails
    marker = json.loads((folder / trained_cache.MARKER).read_text())
    marker["files"]["config.json"] = (folder / "config.json").stat().st_size
    (folder / trained_cache.MARKER).write_text(json.dumps(marker))
    model, _ = trained.load_hf(gguf)
    assert len(calls) == 3 and model.config.num_hidden_layers >= 1


def test_config_from_a_gguf_header_alone(tmp_path, monkeypatch):
    """``model_config`` of a GGUF with no converted cache reads only its header."""
    gguf = trained_sources.shipped_gguf("gemma3-270m")
    monkeypatch.setenv("TORCH_KVQ_CACHE", str(tmp_path))  # no converted folder there
    cfg = trained.model_config(gguf)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.head_dim, cfg.sliding_window) == (
        "gemma3_text",
        18,
        256,
        512,
    )
    assert cfg.layer_types[4:6] == ["sliding_attention", "full_attention"]
    assert cfg.vocab_size == 262144 and cfg.tie_word_embeddings


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(trained_sources.SHIPPED))
def test_header_config_equals_autoconfig(name):
    """The fast header path gives what transformers' own GGUF config path gives (minutes)."""
    import transformers

    gguf = trained_sources.shipped_gguf(name)
    fast = trained._header_config(gguf).to_dict()
    slow = transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).to_dict()
    fast.pop("_name_or_path"), slow.pop("_name_or_path")
    assert fast == slow
