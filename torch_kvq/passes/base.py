"""What a pass is (``KVQPass``) and what it is given (``PassContext``).

A pass is an instance of a ``KVQPass`` subclass: ``name``, a few class attributes the manager and
the report read, and ``__call__(graph, ctx) -> matches``. Adding a pass is one module with one
such class (+ its test); ``make_kvq_backend(passes=[...])`` also takes pass objects directly::

    class MyPass(KVQPass):
        name = "my_pass"
        reads_stamps = True          # runs after annotate (it reads node.meta["kvq"])

        def __call__(self, graph, ctx):
            ...                      # rewrite graph in place; ctx.decide(layer, "...")
            return matches
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from torch import fx

from torch_kvq.passes.stamp import KVQStamp


@dataclass
class PassContext:
    """Per-graph state a pass may read (the manager's stamps) and write (its decisions)."""

    stamps: Mapping[str, KVQStamp]
    decisions: dict[str, str] = field(default_factory=dict)

    def decide(self, layer: str, decision: str) -> None:
        """Record ``decision`` for ``layer`` in the current pass (the first one recorded wins)."""
        self.decisions.setdefault(layer, decision)


class KVQPass:
    """A post-grad pass: rewrites ``graph`` in place and returns its number of matches.

    Class attributes the manager and the report read:

    - ``name``: unique; names the pass in the report, the dumps and ``passes=[...]``.
    - ``writes_stamps``: it stamps ``node.meta["kvq"]`` (``annotate``).
    - ``reads_stamps``: it reads the stamps, so a stamping pass must run before it.
    - ``fusion``: what the report counts when this pass fuses a layer (``"quant+write"``), for a
      fusion pass; its decision for a fused layer is ``"fused " + fusion``. None: not a fusion.

    ``uuid()`` keys Inductor's FX graph cache: by default a hash of the class's source; a pass
    whose behaviour depends on constructor arguments, or on helpers outside its class, must
    override it to cover them.
    """

    name: ClassVar[str]
    writes_stamps: ClassVar[bool] = False
    reads_stamps: ClassVar[bool] = False
    fusion: ClassVar[str | None] = None

    def __call__(self, graph: fx.Graph, ctx: PassContext) -> int:
        raise NotImplementedError

    @classmethod
    def decision(cls) -> str:
        """The decision text a fusion pass records for a layer it fused."""
        if cls.fusion is None:
            raise TypeError(f"pass {cls.name!r} is not a fusion")
        return f"fused {cls.fusion}"

    def uuid(self) -> str:
        """A stable key for this pass's behaviour (its class's source; see the class doc)."""
        cls = type(self)
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            raise ValueError(
                f"pass {cls.__qualname__} ({cls.name!r}): its source cannot be read, so it cannot "
                "key Inductor's FX graph cache; give the class a uuid() method returning a string "
                "that changes whenever the pass does"
            ) from None
        key = f"{cls.__module__}.{cls.__qualname__}\n{source}"
        return hashlib.sha256(key.encode()).hexdigest()
