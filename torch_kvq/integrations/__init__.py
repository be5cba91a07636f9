"""Integrations with models torch-kvq did not write. Only this package imports transformers.

``from torch_kvq.integrations.transformers import KVQCausalLM`` (or ``torch_kvq.integrations
.KVQCausalLM``, loaded on first use so that importing ``torch_kvq`` never imports transformers).
"""

from __future__ import annotations


def __getattr__(name: str) -> object:
    if name in ("KVQCausalLM", "KVQPagedCache"):
        from torch_kvq.integrations import transformers as hf

        return getattr(hf, name)
    raise AttributeError(f"module 'torch_kvq.integrations' has no attribute {name!r}")


__all__ = ["KVQCausalLM", "KVQPagedCache"]
