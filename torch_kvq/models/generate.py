"""Greedy generation through the paged cache: one mixed prefill batch, then decode steps.

``forward`` may be a compiled model (``torch.compile(model, backend=kvq_backend)``); the model
still provides the allocator and the forward context. Pages are freed at the end, also on error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torch_kvq.attention.graph_runner import DecodeGraphRunner
from torch_kvq.attention.metadata import BatchMetadata
from torch_kvq.distributed import agreed, refuse_together
from torch_kvq.models.base import PagedDecoder
from torch_kvq.spec import check_positive_int

# forward(input_ids [T], positions [T], logits_indices=None) -> logits [T or len(indices), vocab]
Forward = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class GenerateResult:
    """tokens[i]: the ``max_new_tokens`` tokens after prompt i. logits [B, max_new_tokens, vocab]
    fp32: ``logits[i, s]`` is what chose ``tokens[i][s]`` (step 0 is the prefill's last position).
    prefill_logits[i]: [len(prompt i), vocab] fp32, the prefill logits of prompt i, when asked
    for (``generate(..., prefill_logits=True)``), else None."""

    tokens: list[list[int]]
    logits: torch.Tensor
    prefill_logits: list[torch.Tensor] | None


def _check_ids(what: str, ids: Sequence[Sequence[int]], vocab: int) -> None:
    for i, seq in enumerate(ids):
        if isinstance(seq, torch.Tensor):
            raise ValueError(
                f"{what}[{i}] is a tensor; expected a list of int token ids (.tolist() of it), "
                "or pass one 2-D integer tensor [batch, tokens]"
            )
        if not seq:
            raise ValueError(f"{what}[{i}] is empty; expected at least one token id")
        bad = [
            t for t in seq if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(
                f"{what}[{i}] has token ids {bad[:4]} outside [0, {vocab}) or not ints"
            )


def _prompt_lists(prompts: list[list[int]] | torch.Tensor) -> list[list[int]]:
    """A 2-D integer tensor [batch, tokens] as one list of ids per row; anything else as given."""
    if not isinstance(prompts, torch.Tensor):
        return prompts
    if prompts.dim() != 2 or prompts.dtype.is_floating_point or prompts.dtype.is_complex:
        raise ValueError(
            f"prompts as a tensor must be a 2-D integer tensor [batch, tokens], got "
            f"{prompts.dtype} of shape {tuple(prompts.shape)}; prompts of different lengths: a "
            "list of token-id lists (.tolist() of each)"
        )
    return prompts.tolist()


@torch.no_grad()
def generate(
    model: PagedDecoder,
    prompts: list[list[int]] | torch.Tensor,
    max_new_tokens: int,
    forward: Forward | None = None,
    *,
    force_tokens: Sequence[Sequence[int]] | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
    decode: DecodeGraphRunner | None = None,
    prefill_logits: bool = False,
) -> GenerateResult:
    """Greedy decoding of ``prompts`` (sequences of different lengths, one batch): lists of
    token ids, or a 2-D integer tensor [batch, tokens] of prompts of one length.

    ``force_tokens`` (one list of ``max_new_tokens`` ids per prompt) feeds those tokens instead of
    the argmax, so two models can be compared along the same path; ``tokens`` then equals it and
    ``logits.argmax(-1)`` is the model's own choice. ``on_step(done, total, seconds)`` is called
    after each forward pass (the prefill is step 1 of ``max_new_tokens``) with its wall time.
    ``decode``, a ``DecodeGraphRunner`` built for ``model``, runs every decode step.
    The prefill computes logits at each prompt's last position only (``forward(ids, positions,
    logits_indices=...)``, as transformers' ``logits_to_keep``); ``prefill_logits=True`` asks for
    every position's. Every step passes ``logits_indices`` (all rows where all are wanted), so a
    compiled forward serves the prefill and the decode steps with one graph.

    A tensor-parallel model (``model.tp``): every rank calls it with the same arguments; a
    refusal on one rank (bad arguments, no free pages) is raised on every rank before the step.
    """
    tp = getattr(model, "tp", None)
    with refuse_together(tp, "generate call", (prompts, max_new_tokens, force_tokens)):
        prompts = _prompt_lists(prompts)
        _check_args(model, prompts, max_new_tokens, force_tokens, decode)
    run = forward if forward is not None else model
    dev = model.device
    seq_ids = [object() for _ in prompts]  # unique keys: other sequences may share the allocator

    def build(new: list[int], device: torch.device | str) -> BatchMetadata:
        reqs = list(zip(seq_ids, new))
        return agreed(tp, "batch", lambda: model.allocator.build_batch(reqs, device), new)

    tokens: list[list[int]] = [[] for _ in prompts]
    step_logits: list[torch.Tensor] = []
    try:
        md = build([len(p) for p in prompts], dev)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
        ends = [int(e) - 1 for e in md.qo_indptr[1:].tolist()]
        rows = (
            torch.arange(len(ids), device=dev) if prefill_logits else torch.tensor(ends, device=dev)
        )
        with model.forward_context(md):  # logits_indices always given: one compiled graph
            t0 = time.perf_counter()
            logits = run(ids, md.positions, logits_indices=rows)
        if on_step is not None:
            on_step(1, max_new_tokens, time.perf_counter() - t0)
        last, prefill = logits, None
        if prefill_logits:
            prefill = [logits[e + 1 - n : e + 1] for e, n in zip(ends, md.qo_lens)]
            last = logits[ends]
        for step in range(max_new_tokens):
            step_logits.append(last)
            chosen = (
                last.argmax(-1).tolist()
                if force_tokens is None
                else [f[step] for f in force_tokens]
            )
            for i, t in enumerate(chosen):
                tokens[i].append(int(t))
            if step + 1 == max_new_tokens:
                break
            ids = torch.tensor(chosen, dtype=torch.long, device=dev)
            t0 = time.perf_counter()
            if decode is not None:  # the runner reads the batch's host fields only
                last = decode(ids, build([1] * len(seq_ids), "cpu"))
            else:
                md = build([1] * len(seq_ids), dev)
                with model.forward_context(md):  # logits_indices as in the prefill: one graph
                    last = run(ids, md.positions, logits_indices=(md.qo_indptr[1:] - 1).long())
            if on_step is not None:
                on_step(step + 2, max_new_tokens, time.perf_counter() - t0)
    finally:
        for sid in seq_ids:
            if sid in model.allocator.sequences:
                model.allocator.free(sid)
    return GenerateResult(
        tokens=tokens, logits=torch.stack(step_logits, dim=1), prefill_logits=prefill
    )


def _check_args(
    model: PagedDecoder,
    prompts: list[list[int]],
    max_new_tokens: int,
    force_tokens: Sequence[Sequence[int]] | None,
    decode: DecodeGraphRunner | None,
) -> None:
    vocab = model.config.vocab_size
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(
            f"prompts must be a non-empty list of token-id lists or a 2-D integer tensor, got "
            f"{prompts!r}"
        )
    _check_ids("prompts", prompts, vocab)
    check_positive_int(max_new_tokens, "max_new_tokens")
    if force_tokens is not None:
        if len(force_tokens) != len(prompts) or any(len(f) != max_new_tokens for f in force_tokens):
            raise ValueError(
                f"force_tokens must hold {len(prompts)} lists of {max_new_tokens} token ids, got "
                f"lengths {[len(f) for f in force_tokens]}"
            )
        _check_ids("force_tokens", force_tokens, vocab)
    if decode is not None and decode.model is not model:
        raise ValueError(
            f"decode is a DecodeGraphRunner for another model ({type(decode.model).__name__} "
            f"{getattr(decode.model, 'prefix', '?')!r}), expected one built for this model "
            f"({getattr(model, 'prefix', '?')!r})"
        )
