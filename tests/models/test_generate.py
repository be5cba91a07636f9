"""generate(): batching, paging, forced tokens, the forward hook, validation, page hygiene."""

from __future__ import annotations

import pytest
import torch

from torch_kvq import KVCacheConfig
from torch_kvq.attention import OutOfPagesError
from torch_kvq.models import build_model, generate

KV = KVCacheConfig(page_size=4)
PROMPTS = [[1, 2, 3, 4, 5], [7, 6] * 7, [9, 8]]


@pytest.fixture(scope="module")
def fp32_model():
    return build_model("gemma3-tiny", KV, num_pages=32, dtype=torch.float32)


def test_one_batch_equals_each_prompt_alone(fp32_model):
    batch = generate(fp32_model, PROMPTS, 5, prefill_logits=True)
    assert batch.logits.shape == (3, 5, 512)
    assert [p.shape for p in batch.prefill_logits] == [(5, 512), (14, 512), (2, 512)]
    for i, p in enumerate(PROMPTS):
        alone = generate(fp32_model, [p], 5, prefill_logits=True)
        assert alone.tokens[0] == batch.tokens[i]
        torch.testing.assert_close(alone.logits[0], batch.logits[i], atol=1e-5, rtol=0)
        torch.testing.assert_close(
            alone.prefill_logits[0], batch.prefill_logits[i], atol=1e-5, rtol=0
        )
    assert batch.tokens == [row.tolist() for row in batch.logits.argmax(-1)]
    assert fp32_model.allocator.num_free_pages == 32


def test_prefill_logits_only_when_asked(fp32_model):
    """By default the prefill computes each prompt's last position only (logits_indices), with the
    same logits and tokens as asking for every position."""
    seen: list[tuple[int, int]] = []

    def forward(ids, positions, logits_indices=None):
        out = fp32_model(ids, positions, logits_indices=logits_indices)
        seen.append((ids.shape[0], out.shape[0]))
        return out

    lean = generate(fp32_model, PROMPTS, 3, forward=forward)
    full = generate(fp32_model, PROMPTS, 3, prefill_logits=True)
    assert lean.prefill_logits is None and len(full.prefill_logits) == 3
    assert seen[0] == (21, 3)  # 5 + 14 + 2 prompt tokens, 3 rows of logits
    assert lean.tokens == full.tokens
    torch.testing.assert_close(lean.logits, full.logits, atol=1e-5, rtol=0)


def test_force_tokens_feeds_them(fp32_model):
    free = generate(fp32_model, PROMPTS, 4, prefill_logits=True)
    forced_path = [[3, 1, 4, 1]] * 3
    forced = generate(fp32_model, PROMPTS, 4, force_tokens=forced_path, prefill_logits=True)
    assert forced.tokens == forced_path
    assert torch.equal(forced.logits[:, 0], free.logits[:, 0])  # same prefill
    assert not torch.allclose(forced.logits[:, 1:], free.logits[:, 1:])  # different path after


def test_forward_hook_is_called_once_per_step(fp32_model):
    calls: list[int] = []

    def forward(ids: torch.Tensor, positions: torch.Tensor, logits_indices=None) -> torch.Tensor:
        calls.append(ids.numel())
        return fp32_model(ids, positions, logits_indices=logits_indices)

    generate(fp32_model, PROMPTS, 4, forward=forward, prefill_logits=True)
    assert calls == [21, 3, 3, 3]


def test_pages_are_freed_when_forward_raises(fp32_model):
    def broken(ids: torch.Tensor, positions: torch.Tensor, logits_indices=None) -> torch.Tensor:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        generate(fp32_model, PROMPTS, 3, forward=broken, prefill_logits=True)
    assert fp32_model.allocator.num_free_pages == 32 and not fp32_model.allocator.sequences


def test_out_of_pages_is_clear_and_leaves_no_pages_taken():
    m = build_model("llama-tiny", KV, num_pages=5)
    with pytest.raises(OutOfPagesError, match="needs 7 new pages of 4 tokens, 5 of 5 are free"):
        generate(m, PROMPTS, 2, prefill_logits=True)
    assert m.allocator.num_free_pages == 5
    with pytest.raises(OutOfPagesError):  # prefill fits (5 pages), decode needs a 6th
        generate(m, [[1] * 20], 2, prefill_logits=True)
    assert m.allocator.num_free_pages == 5


@pytest.mark.parametrize(
    "prompts, n, force, message",
    [
        ([], 2, None, "prompts must be a non-empty list"),
        ([[1], []], 2, None, r"prompts\[1\] is empty"),
        ([[1, 512]], 2, None, r"prompts\[0\] has token ids \[512\] outside \[0, 512\)"),
        ([[1, -1]], 2, None, r"token ids \[-1\]"),
        ([[1]], 0, None, "max_new_tokens must be a positive int, got 0"),
        ([[1]], 2, [[1]], "force_tokens must hold 1 lists of 2 token ids"),
        ([[1]], 2, [[1, 999]], r"force_tokens\[0\] has token ids \[999\]"),
    ],
)
def test_bad_arguments(fp32_model, prompts, n, force, message):
    with pytest.raises(ValueError, match=message):
        generate(fp32_model, prompts, n, force_tokens=force, prefill_logits=True)
    assert fp32_model.allocator.num_free_pages == 32


def test_a_2d_integer_tensor_is_a_batch_of_prompts(fp32_model):
    rows = [[1, 2, 3, 4], [9, 8, 7, 6]]
    as_lists = generate(fp32_model, rows, 3, prefill_logits=True)
    as_tensor = generate(fp32_model, torch.tensor(rows), 3, prefill_logits=True)
    assert as_tensor.tokens == as_lists.tokens
    torch.testing.assert_close(as_tensor.logits, as_lists.logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        generate(fp32_model, torch.zeros(1, 0, dtype=torch.long), 2, prefill_logits=True)
    assert fp32_model.allocator.num_free_pages == 32


def test_on_step_reports_every_forward_pass():
    from torch_kvq.models import build_model, generate
    from torch_kvq.spec import KVCacheConfig

    model = build_model("llama-tiny", KVCacheConfig())
    seen = []
    generate(
        model,
        [[1, 2, 3], [4]],
        4,
        on_step=lambda done, total, s: seen.append((done, total, s)),
        prefill_logits=True,
    )
    assert [(d, t) for d, t, _ in seen] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert all(s > 0 for _, _, s in seen)


def test_decode_steps_through_a_graph_runner_match(fp32_model):
    """decode=DecodeGraphRunner: same tokens and logits (capture=False runs its fixed-buffer,
    padded path on the CPU: 3 prompts in a 4-slot)."""
    from torch_kvq.attention.graph_runner import DecodeGraphRunner

    with DecodeGraphRunner(fp32_model, batch_sizes=(4,), max_context=32, capture=False) as runner:
        assert fp32_model.allocator.num_free_pages == 31  # its scratch page
        plain = generate(fp32_model, PROMPTS, 5, prefill_logits=True)
        graphed = generate(fp32_model, PROMPTS, 5, decode=runner, prefill_logits=True)
        assert graphed.tokens == plain.tokens
        torch.testing.assert_close(graphed.logits, plain.logits, atol=1e-4, rtol=0)
    assert fp32_model.allocator.num_free_pages == 32  # close() gave it back
