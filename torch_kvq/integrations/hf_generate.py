"""``hf_model.generate(...)`` through the paged cache: a placeholder ``Cache`` plus a forward that
turns HF's left-padded ``[B, S]`` batch into one flat ``[1, T]`` batch.

``KVQPagedCache`` holds no tensors: K and V live in each layer's ``torch_kvq.Attention`` cache. It
only maps the B rows of ``generate``'s batch to allocator sequences. Its ``is_compileable`` is
False, so ``generate`` never auto-compiles and never builds 4D masks. The forward installed on the
HF model at attach (``install_forward``) serves a call that carries this cache: it drops the
padding, builds the batch metadata (positions count real tokens only, as HF's
``cumsum(mask) - 1``), runs the model flat inside the forward context and scatters the logits
back to ``[B, S, vocab]`` (``[B, 1, vocab]`` when ``logits_to_keep=1``). Refused: right padding (a
pad after a real token), ``inputs_embeds``, a batch whose size changes (beam search), cropping
(assisted decoding), and any other HF cache (it would write K/V a second time).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import Cache

if TYPE_CHECKING:
    from torch_kvq.integrations.transformers import KVQCausalLM

CACHE_KWARGS = ("cache", "past_key_values")  # transformers 5.x name, 4.x name


class KVQPagedCache(Cache):
    """Placeholder HF cache for one ``generate`` call on a ``KVQCausalLM`` (pages in its allocator).

    Use once: ``lm.generate(...)``, or ``with lm.paged_cache() as cache:
    hf_model.generate(..., past_key_values=cache)`` (``cache=`` on transformers 5.x); leaving the
    block (or ``close()``) frees every page.
    """

    def __init__(self, lm: KVQCausalLM) -> None:
        try:
            super().__init__(layers=[])
        except TypeError:  # transformers < 4.56: Cache(layer_classes, ...); set what it would
            self.layers = []
            self.cache_processor = None
        self.lm = lm
        self.seq_ids: list[object] = []
        self.columns = 0  # padded columns of generate's batch seen so far
        self.closed = False

    # --- what generate asks of a cache ---------------------------------------------------------

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return False

    @property
    def is_linear(self) -> list[bool]:  # type: ignore[override]
        return [False]

    @property
    def is_sliding(self) -> list[bool]:  # type: ignore[override]
        return [False]

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        return False

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.columns

    def update(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("KVQPagedCache holds no K/V: the torch_kvq Attention layers write them")

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        raise ValueError("KVQPagedCache cannot reorder sequences: beam search is unsupported")

    def crop(self, max_length: int) -> None:
        raise ValueError(
            "KVQPagedCache cannot crop: assisted / speculative decoding is unsupported"
        )

    # --- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Free every page this cache's sequences hold (idempotent)."""
        alloc = self.lm.allocator
        for sid in self.seq_ids:
            if sid in alloc.sequences:
                alloc.free(sid)
        self.closed = True

    def __enter__(self) -> KVQPagedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- serving one forward -------------------------------------------------------------------

    def _new_tokens(self, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """[B, S] ids and the 2D mask -> [B, S] bool: which of the S new columns are real tokens."""
        b, s = input_ids.shape
        if s == 0:  # the allocator would name the sequence by its key, an object()
            raise ValueError(
                f"input_ids of shape {tuple(input_ids.shape)} has no tokens; expected at least "
                "one token id per prompt"
            )
        if mask is None:
            return torch.ones(b, s, dtype=torch.bool, device=input_ids.device)
        if mask.dim() != 2 or mask.shape[0] != b or mask.shape[1] != self.columns + s:
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)}, expected a 2D mask "
                f"[{b}, {self.columns + s}] (columns seen so far plus the new ones)"
            )
        new = mask[:, -s:].to(torch.bool)
        if self.seq_ids:
            if not bool(new.all()):
                raise ValueError(
                    "a padding column after the prompt (right padding or a gap): the paged cache "
                    "serves left-padded batches only; pad on the left (tokenizer padding_side='left')"
                )
            return new
        if bool((new[:, 1:].int() < new[:, :-1].int()).any()):
            raise ValueError(
                "right padding: a padding token follows a real token in the prompt batch; the "
                "paged cache serves left-padded batches only (tokenizer padding_side='left')"
            )
        if not bool(new[:, -1].all()):
            empty = (~new[:, -1]).nonzero().flatten().tolist()
            raise ValueError(f"prompt rows {empty} have no tokens (all padding)")
        return new

    def serve(
        self, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run ``forward`` (the HF model's own) flat for one ``generate`` step."""
        if self.closed:
            raise RuntimeError("this KVQPagedCache was closed; use a new one per generate call")
        kwargs = dict(kwargs)
        input_ids = kwargs.pop("input_ids", args[0] if args else None)
        if kwargs.get("inputs_embeds") is not None or input_ids is None:
            raise ValueError("the paged cache serves input_ids; inputs_embeds is unsupported")
        mask = kwargs.pop("attention_mask", None)
        for key in (*CACHE_KWARGS, "position_ids", "use_cache", "cache_position"):
            kwargs.pop(key, None)
        keep = kwargs.pop("logits_to_keep", 0)
        if not isinstance(keep, int) or isinstance(keep, bool):
            raise ValueError(f"logits_to_keep must be an int here, got {type(keep).__name__}")
        real = self._new_tokens(input_ids, mask)
        b, s = input_ids.shape
        counts = real.sum(1).tolist()
        if not self.seq_ids:
            self.seq_ids = [object() for _ in range(b)]
        elif len(self.seq_ids) != b:
            raise ValueError(
                f"the batch changed from {len(self.seq_ids)} to {b} rows (beam search?); the paged "
                "cache serves one fixed batch per generate call"
            )
        lm = self.lm
        md = lm.allocator.build_batch(list(zip(self.seq_ids, counts)), lm.device)
        self.columns += s
        flat = input_ids[real].to(lm.device)
        last = (md.qo_indptr[1:] - 1).to(torch.long)
        with lm.forward_context(md):
            out = forward(
                input_ids=flat[None],
                position_ids=md.positions[None],
                use_cache=False,
                logits_to_keep=last if keep == 1 else 0,
                **kwargs,
            )
        logits = out.logits[0]  # [K, vocab]
        if keep == 1:
            out.logits = logits.view(b, 1, -1)
        else:
            full = logits.new_zeros(b, s, logits.shape[-1])
            full[real] = logits
            out.logits = full[:, -keep:] if keep else full
        return out


def install_forward(lm: KVQCausalLM) -> Callable[..., Any]:
    """Wrap ``lm.hf.forward`` (an instance attribute, same signature for ``generate``'s checks):
    a call carrying a ``KVQPagedCache`` is served flat; any other cache, or ``use_cache`` left on,
    is refused (HF would write K/V into its own cache as well). Returns the original forward."""
    hf = lm.hf
    original = hf.forward
    # Neither lm nor hf is held strongly: no reference cycle, so dropping the model frees its
    # layers (and their names) at once, not at the next garbage collection.
    func, hf_ref = type(hf).forward, weakref.ref(hf)
    config, cls_name = lm.config, type(hf).__name__

    @functools.wraps(func)
    def forward(*args: Any, **kwargs: Any) -> Any:
        model = hf_ref()
        cache = next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)
        if isinstance(cache, KVQPagedCache):
            return cache.serve(functools.partial(func, model), args, kwargs)
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(config, "use_cache", False)
        if cache is not None or use_cache:
            what = (
                f"an HF cache ({type(cache).__name__})" if cache is not None else "use_cache=True"
            )
            raise ValueError(
                f"{cls_name} is attached to the torch-kvq paged cache; {what} would write "
                "K/V a second time (a double write). Call it with use_cache=False and no cache "
                "inside lm.forward_context(...), or generate with lm.generate(...)"
            )
        return func(model, *args, **kwargs)

    forward.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    hf.forward = forward
    return original
