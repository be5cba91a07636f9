"""Perplexity and generation agreement of a model under KV-cache configs, against the same model
with a model-dtype cache (``kv_cache_dtype="auto"``), on fixed Brown Corpus text.

Three measurements per config (``measure``), all through the paged cache of a ``KVQCausalLM``:

- **ppl**: teacher-forced perplexity over ``windows`` fixed windows of ``window`` tokens (window i
  is the first ``window`` tokens of text i of the corpus's eval split, tokenized with the model's
  tokenizer, its BOS included when the tokenizer adds one), computed by prefill: each window is
  one sequence, prefilled in chunks of as many tokens as keep one chunk's fp32 logits under
  ``LOGIT_BUDGET_BYTES`` (all at once for a small vocabulary; 256 tokens for Gemma's 262k).
  In this project a prefill writes the step's k/v into the cache first and attends over the cache,
  so prefill already reads the quantized K/V back (FP8 codes times the scale), never fresh k/v.
- **decode ppl**: the last ``decode_tokens`` tokens of every window, each predicted by a one-token
  decode step (teacher-forced: the corpus token is fed, not the argmax), after a prefill of the
  tokens before them; all windows decode together as one batch. Every step reads the whole
  quantized context back, as serving does.
- **agreement**: greedy generation of ``new_tokens`` tokens from ``prompts`` fixed prompts (the
  first ``prompt_tokens`` tokens of the eval texts): the fraction of generated tokens equal to the
  reference run's at the same step, and per prompt the length of the common prefix.

Runs are deterministic (no sampling; ``torch.manual_seed(seed)`` first). Several configs share one
loaded model (``configure_kv`` swaps the caches). With ``compile`` the forward is
``torch.compile(lm, backend=make_kvq_backend(inner="eager"))``: the kvq passes fuse the quantized
layers' attention, so the kernels' fused paths (FlashInfer / Triton / XQA) run; eager runs the
unfused form, in which the FP8 decode kernel choice has no effect.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torch_kvq.models.generate import generate
from torch_kvq.progress import Progress
from torch_kvq.spec import KVCacheConfig, check_positive_int

LOGIT_BUDGET_BYTES = 256 << 20  # fp32 logits of one prefill chunk stay under this
Forward = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class EvalSettings:
    """Windows, decode phase and generation of one evaluation (defaults: the shipped table's)."""

    window: int = 1024  # tokens per window: longer than Gemma-3's 512-token sliding window
    windows: int = 4
    decode_tokens: int = 128  # the last tokens of every window, fed one per step (0: no decode)
    prompts: int = 4
    prompt_tokens: int = 32
    new_tokens: int = 32  # greedy tokens per prompt (0: no generation)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("window", "windows", "prompts", "prompt_tokens"):
            check_positive_int(getattr(self, name), name)
        for name in ("decode_tokens", "new_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.decode_tokens > self.window - 2:
            raise ValueError(
                f"decode_tokens {self.decode_tokens} must leave a prefill: at most window - 2 "
                f"= {self.window - 2}"
            )

    def pages_needed(self, page_size: int) -> int:
        """KV pages per layer the evaluation holds at once (all windows decode together)."""
        per = lambda n: -(-n // page_size)  # noqa: E731
        return max(
            self.windows * per(self.window),
            self.prompts * per(self.prompt_tokens + self.new_tokens),
        )


@dataclass(frozen=True)
class EvalData:
    """The token ids an evaluation reads, and which corpus texts they came from."""

    windows: tuple[tuple[int, ...], ...]
    window_files: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]
    prompt_files: tuple[str, ...]


def eval_data(tokenizer, settings: EvalSettings, texts: Sequence[tuple[str, str]]) -> EvalData:
    """Windows and prompts from ``texts`` (``corpus.split("eval")``) in their order; a text too
    short for a window is passed over; too few texts is a ValueError."""
    windows, files = [], []
    prompts, prompt_files = [], []
    for fid, text in texts:
        ids = tokenizer(text)["input_ids"]
        if len(windows) < settings.windows and len(ids) >= settings.window:
            windows.append(tuple(ids[: settings.window]))
            files.append(fid)
        if len(prompts) < settings.prompts and len(ids) >= settings.prompt_tokens:
            prompts.append(tuple(ids[: settings.prompt_tokens]))
            prompt_files.append(fid)
    if len(windows) < settings.windows:
        raise ValueError(
            f"the eval split has {len(windows)} texts of at least {settings.window} tokens; "
            f"asked for {settings.windows} windows"
        )
    return EvalData(tuple(windows), tuple(files), tuple(prompts), tuple(prompt_files))


@dataclass(frozen=True)
class Measured:
    """What one config measured (see the module docstring)."""

    ppl: float
    decode_ppl: float
    tokens: tuple[tuple[int, ...], ...]  # greedy continuation of each prompt
    seconds: float


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum over rows of -log softmax(logits)[target], in fp64."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    picked = logits.float().gather(-1, targets[:, None].to(logits.device))[:, 0]
    return float((lse - picked).double().sum())


def keeps_logits(lm: torch.nn.Module) -> bool:
    """Whether ``lm.forward`` takes ``logits_indices`` (the rows whose logits to compute)."""
    return "logits_indices" in inspect.signature(type(lm).forward).parameters


class _Runner:
    """Runs token chunks of sequences through ``forward`` inside ``lm``'s forward context."""

    def __init__(self, lm: torch.nn.Module, forward: Forward) -> None:
        self.lm, self.forward = lm, forward
        self.keep = keeps_logits(lm)  # compiled forwards pass the keyword through
        self.chunk = max(1, LOGIT_BUDGET_BYTES // (4 * lm.config.vocab_size))

    def step(self, requests: list[tuple[object, list[int]]], last_only: bool = False):
        md = self.lm.allocator.build_batch([(s, len(t)) for s, t in requests], self.lm.device)
        ids = torch.tensor([t for _, ts in requests for t in ts], device=self.lm.device)
        kw = {}
        if self.keep:  # always given (every row, or each sequence's last): one compiled graph
            rows = md.qo_indptr[1:] - 1 if last_only else torch.arange(len(ids), device=ids.device)
            kw["logits_indices"] = rows.long()
        with self.lm.forward_context(md):
            return self.forward(ids, md.positions, **kw)

    def prefill(self, seq: object, ids: Sequence[int], targets: Sequence[int] | None) -> float:
        """Prefill ``ids`` in chunks; the NLL of ``targets`` (``ids`` shifted) if given."""
        total = 0.0
        for start in range(0, len(ids), self.chunk):
            part = list(ids[start : start + self.chunk])
            logits = self.step([(seq, part)], last_only=targets is None)
            if targets is not None:
                tgt = torch.tensor(targets[start : start + len(part)])
                total += _nll(logits, tgt)
            del logits
        return total


@torch.no_grad()
def teacher_forced_ppl(
    lm: torch.nn.Module,
    windows: Sequence[Sequence[int]],
    forward: Forward | None = None,
    bar: Progress | None = None,
) -> float:
    """Perplexity of ``windows`` (each one sequence, prefilled in chunks; module docstring)."""
    run = _Runner(lm, forward if forward is not None else lm)
    nll, count = 0.0, 0
    for i, win in enumerate(windows):
        _say(bar, f"prefill window {i + 1}/{len(windows)}")
        seq = object()
        try:
            nll += run.prefill(seq, win[:-1], win[1:])
        finally:
            if seq in lm.allocator.sequences:
                lm.allocator.free(seq)
        count += len(win) - 1
    return math.exp(nll / count)


@torch.no_grad()
def decode_ppl(
    lm: torch.nn.Module,
    windows: Sequence[Sequence[int]],
    decode_tokens: int,
    forward: Forward | None = None,
    bar: Progress | None = None,
) -> float:
    """Perplexity of the last ``decode_tokens`` tokens of every window, each predicted by a
    one-token decode step after a prefill of the tokens before them (all windows one batch)."""
    run = _Runner(lm, forward if forward is not None else lm)
    n = len(windows[0])
    p = n - decode_tokens - 1
    seqs = [object() for _ in windows]
    nll = 0.0
    try:
        for seq, win in zip(seqs, windows):
            run.prefill(seq, win[:p], None)
        for s in range(decode_tokens):
            if s % 16 == 0:
                _say(bar, f"decode step {s + 1}/{decode_tokens}")
            logits = run.step([(seq, [win[p + s]]) for seq, win in zip(seqs, windows)])
            nll += _nll(logits, torch.tensor([win[p + s + 1] for win in windows]))
    finally:
        for seq in seqs:
            if seq in lm.allocator.sequences:
                lm.allocator.free(seq)
    return math.exp(nll / (decode_tokens * len(windows)))


@torch.no_grad()
def measure(
    lm: torch.nn.Module,
    data: EvalData,
    settings: EvalSettings,
    forward: Forward | None = None,
    bar: Progress | None = None,
) -> Measured:
    """ppl, decode ppl and greedy tokens of ``lm`` as configured now (module docstring); a
    phase turned off (``decode_tokens`` / ``new_tokens`` 0) gives NaN / no tokens."""
    torch.manual_seed(settings.seed)
    t0 = time.perf_counter()
    ppl = teacher_forced_ppl(lm, data.windows, forward, bar)
    dppl = math.nan
    if settings.decode_tokens:
        dppl = decode_ppl(lm, data.windows, settings.decode_tokens, forward, bar)
    tokens: tuple[tuple[int, ...], ...] = ()
    if settings.new_tokens:
        _say(bar, f"greedy generation of {settings.new_tokens} tokens")
        out = generate(lm, [list(p) for p in data.prompts], settings.new_tokens, forward=forward)
        tokens = tuple(map(tuple, out.tokens))
    return Measured(ppl, dppl, tokens, time.perf_counter() - t0)


def _say(bar: Progress | None, status: str) -> None:
    if bar is not None:
        bar.update(status=status)


def compiled(lm: torch.nn.Module) -> Forward:
    """``torch.compile(lm, backend=make_kvq_backend(inner="eager"))`` with the token axis
    dynamic (one graph for every multi-token step); Dynamo is reset first (one config per
    compile, so earlier configs' graphs do not count towards its recompile limit)."""
    from torch_kvq.passes import make_kvq_backend

    torch._dynamo.reset()
    return lm.compiled_forward(backend=make_kvq_backend(inner="eager"))


@dataclass(frozen=True)
class EvalRow:
    """One model x KV config x kernel: the measurement against the reference run."""

    model: str
    kv: str  # the config's label
    spec: str  # what it was written as (``--kv``), or "auto" for the reference
    kernel: str
    compile: str  # "off" | "kvq"
    dtype: str
    quantized_layers: int
    layers: int
    ppl: float
    ppl_delta_pct: float
    decode_ppl: float
    decode_delta_pct: float
    agreement: float  # fraction of generated tokens equal to the reference's
    common_prefix: tuple[int, ...]  # per prompt: tokens equal to the reference's before the first
    seconds: float
    continuation: str  # the first prompt's greedy continuation, decoded


def row(
    lm: torch.nn.Module,
    tokenizer,
    got: Measured,
    ref: Measured,
    *,
    model: str,
    kv: str,
    spec: str,
    kernel: str,
    compile: str,
) -> EvalRow:
    """An ``EvalRow`` of ``got`` against the reference ``ref`` (``lm`` as configured for ``got``)."""
    pairs = [(a, b) for ta, tb in zip(got.tokens, ref.tokens) for a, b in zip(ta, tb)]
    agreement = sum(a == b for a, b in pairs) / len(pairs) if pairs else math.nan
    prefix = []
    for ta, tb in zip(got.tokens, ref.tokens):
        n = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), len(ta))
        prefix.append(n)
    return EvalRow(
        model=model,
        kv=kv,
        spec=spec,
        kernel=kernel,
        compile=compile,
        dtype=str(lm.dtype).removeprefix("torch."),
        quantized_layers=sum(s.is_quantized for s in lm.kv_specs),
        layers=len(lm.kv_specs),
        ppl=got.ppl,
        ppl_delta_pct=100.0 * (got.ppl / ref.ppl - 1.0),
        decode_ppl=got.decode_ppl,
        decode_delta_pct=100.0 * (got.decode_ppl / ref.decode_ppl - 1.0),
        agreement=agreement,
        common_prefix=tuple(prefix),
        seconds=got.seconds,
        continuation=tokenizer.decode(list(got.tokens[0])) if got.tokens else "",
    )


def evaluate(
    lm: torch.nn.Module,
    tokenizer,
    configs: Sequence[tuple[str, str, KVCacheConfig]],
    data: EvalData,
    settings: EvalSettings,
    *,
    model: str,
    kernel: str,
    compile: bool = False,
    bar: Progress | None = None,
) -> list[EvalRow]:
    """The reference row (model-dtype cache, same kernel and compile) then one row per
    ``(label, spec, config)``; ``lm`` is left configured with the last config."""
    page = configs[0][2].page_size if configs else 16
    todo = [("auto", "auto", KVCacheConfig(page_size=page)), *configs]
    results: list[tuple[str, str, Measured]] = []
    rows = []
    for label, spec, cfg in todo:
        if bar is not None:
            bar.update(done=bar.done, status=f"{model}: {label}")
        lm.configure_kv(cfg)
        fwd = compiled(lm) if compile else None
        got = measure(lm, data, settings, fwd, bar)
        results.append((label, spec, got))
        ref = results[0][2]
        rows.append(
            row(
                lm,
                tokenizer,
                got,
                ref,
                model=model,
                kv=label,
                spec=spec,
                kernel=kernel,
                compile="kvq" if compile else "off",
            )
        )
        if bar is not None:
            bar.update(done=bar.done + 1)
    return rows


__all__ = ["EvalData", "EvalRow", "EvalSettings", "Measured", "eval_data", "evaluate", "measure"]
