"""Determinism on CPU: the same inputs give bit-identical logits and KV caches, run to run.

Within one process (two freshly built models, and one model run again after resetting its
caches) and across processes (a child Python computes the same digest). A mixed FP8 / bf16 cache
config, a mixed prefill batch of prompts of different lengths, then decode steps.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_kvq.models import build_model, generate
from torch_kvq.spec import KVCacheConfig

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32], [2, 71, 82], [8, 1, 8, 2, 8]]
NEW_TOKENS = 3
LAYERS = dict(
    num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"]
)
CONFIG = dict(kv_cache_dtype="fp8", skip_layers=("sliding_window",), page_size=4)


def run(forward_of=None) -> dict[str, torch.Tensor]:
    """One generate() from a fresh 3-layer gemma3-tiny (sliding bf16, sliding bf16, global FP8),
    optionally through ``forward_of(model)`` (a compiled forward). Returns logits, tokens and
    cache bytes."""
    model = build_model("gemma3-tiny", KVCacheConfig(**CONFIG), seed=0, num_pages=16, **LAYERS)
    forward = forward_of(model) if forward_of is not None else None
    res = generate(model, PROMPTS, NEW_TOKENS, forward, prefill_logits=True)
    out = {"logits": res.logits, "tokens": torch.tensor(res.tokens)}
    out |= {f"prefill{i}": p for i, p in enumerate(res.prefill_logits)}
    for i, attn in enumerate(model.attention_layers):
        out[f"cache{i}"] = attn.kv_cache.view(torch.uint8).clone()
    return out


def digest(out: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(out):
        h.update(key.encode())
        h.update(out[key].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key].view(torch.uint8), b[key].view(torch.uint8)
        assert torch.equal(x, y), f"{key} differs run to run"


def test_eager_is_bitwise_deterministic_in_process() -> None:
    first, second = run(), run()
    assert_bitwise_equal(first, second)
    assert any(first[k].any() for k in first if k.startswith("cache"))  # caches were written


def test_eager_is_bitwise_deterministic_across_processes() -> None:
    here = digest(run())
    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); "
        f"torch.set_num_threads({torch.get_num_threads()}); "
        "from tests.test_determinism import digest, run; print(digest(run()))"
    )
    env = dict(os.environ, PYTHONHASHSEED="0")
    child = subprocess.run(
        [sys.executable, "-c", code, str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip().splitlines()[-1] == here


def compiled_with(inner: str):
    from torch_kvq.passes import make_kvq_backend

    def forward_of(model):
        torch._dynamo.reset()
        return torch.compile(model, backend=make_kvq_backend(inner=inner), fullgraph=True)

    return forward_of


def test_compiled_is_bitwise_deterministic() -> None:
    """Compiled with the passes (``inner="eager"``: the post-grad graph the passes rewrote runs as
    is): two fresh models, two compiles, the same bits."""
    first, second = run(compiled_with("eager")), run(compiled_with("eager"))
    assert_bitwise_equal(first, second)
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_compiled_is_bitwise_deterministic() -> None:
    """The same through Inductor's generated CPU code (``kvq_backend``'s default inner)."""
    first, second = run(compiled_with("inductor")), run(compiled_with("inductor"))
    assert_bitwise_equal(first, second)
    torch._dynamo.reset()
