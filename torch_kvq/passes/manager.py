"""``KVQPassManager``: runs the kvq passes as Inductor's ``post_grad_custom_post_pass``.

Install it yourself with ``torch._inductor.config.patch(post_grad_custom_post_pass=manager)``
or let ``kvq_backend`` do it. It owns what is common to all passes: the per-layer stamps (spec +
kernel capability decisions), timing, per-pass decisions, the report, the log line, and the
before/after dumps. Its ``uuid()`` hashes the pass sources, the options and the per-layer spec
table, so Inductor's FX graph cache never reuses a graph compiled for another skip config.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from torch_kvq.passes import report
from torch_kvq.passes.annotate import AnnotatePass
from torch_kvq.passes.base import KVQPass, PassContext
from torch_kvq.passes.cleanup import CleanupPass
from torch_kvq.passes.dump import PassDumper
from torch_kvq.passes.fuse_attention_output_quant import FuseAttentionOutputQuantPass
from torch_kvq.passes.fuse_dequant_attention import FuseDequantAttentionPass
from torch_kvq.passes.fuse_quant_cache_write import FuseQuantCacheWritePass
from torch_kvq.passes.graph_utils import count_ops
from torch_kvq.passes.stamp import KVQStamp, make_stamp
from torch_kvq.spec import LayerKVSpec
from torch_kvq.spec_table import spec_table_key

logger = logging.getLogger("torch_kvq")

PASSES: dict[str, type[KVQPass]] = {
    cls.name: cls
    for cls in (
        AnnotatePass,
        FuseQuantCacheWritePass,
        FuseDequantAttentionPass,
        FuseAttentionOutputQuantPass,
        CleanupPass,
    )
}
DEFAULT_PASSES: tuple[str, ...] = tuple(PASSES)


def _per_layer(
    value: str | Mapping[str, str] | None, specs: Sequence[LayerKVSpec], what: str
) -> dict[str, str | None]:
    if value is None or isinstance(value, str):
        return {s.name: value for s in specs}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{what} must be a string or a mapping layer name -> string, got {value!r}"
        )
    missing = sorted({s.name for s in specs} - set(value))
    if missing:
        raise ValueError(f"{what} mapping has no entry for layers {missing[:6]}")
    return {s.name: value[s.name] for s in specs}


# what the passes' decisions and rewrites depend on beyond the passes package itself
_DEPENDENCIES = (
    "spec.py",
    "spec_channels.py",
    "spec_modes.py",
    "spec_resolve.py",
    "spec_table.py",
    "attention/ops.py",
    "attention/ops_per_token_head.py",
    "attention/quant.py",
    "attention/kernels/capabilities.py",
)


@cache
def _package_digest() -> str:
    """sha256 over every source file of ``torch_kvq/passes/`` and ``_DEPENDENCIES`` (read from
    disk, so the same in every process whatever it imported): editing any helper module the
    passes run changes the FX graph cache key."""
    root = Path(__file__).resolve().parents[1]
    files = sorted((root / "passes").glob("*.py")) + [root / d for d in _DEPENDENCIES]
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


class KVQPassManager(CustomGraphPass):
    """The kvq post-grad passes for exactly the layers in ``specs``.

    Args:
        specs: the ``LayerKVSpec`` of every attention layer the graph may contain.
        kernel: kernel name serving each layer (one name or layer -> name); None is
            ``"reference"`` (the pure-torch kernel, which has a row for every arch).
        arch: device arch of each layer (``"cpu"``, ``"sm90"``, ...; one or layer -> arch).
        passes: in order, pass names (``PASSES``) or ``KVQPass`` objects (default
            ``DEFAULT_PASSES``); a pass that reads the stamps needs ``annotate`` before it.
        dump_dir: if set, write ``<dump_dir>/graph_NNN/<pass>.before.py`` / ``.after.py`` and
            ``report.txt`` per compiled graph.
    """

    def __init__(
        self,
        specs: Sequence[LayerKVSpec],
        *,
        kernel: str | Mapping[str, str] | None = None,
        arch: str | Mapping[str, str] = "cpu",
        passes: Sequence[str | KVQPass] = DEFAULT_PASSES,
        dump_dir: str | Path | None = None,
    ) -> None:
        self.specs = tuple(specs)
        for s in self.specs:
            if not isinstance(s, LayerKVSpec):
                raise ValueError(f"specs must be LayerKVSpec objects, got {type(s).__name__}")
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(
                f"specs name a layer twice: {sorted({n for n in names if names.count(n) > 1})}"
            )
        archs = _per_layer(arch, self.specs, "arch")
        kernels = _per_layer(kernel, self.specs, "kernel")
        self.stamps: dict[str, KVQStamp] = {
            s.name: make_stamp(s, kernels[s.name] or "reference", archs[s.name] or "cpu")
            for s in self.specs
        }
        self.passes = resolve_passes(passes)
        self.pass_names = tuple(p.name for p in self.passes)
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.runs = 0
        self.last: report.GraphReport | None = None
        self._uuid = self._compute_uuid()

    def _compute_uuid(self) -> str:
        h = hashlib.sha256(b"torch_kvq.passes/1")
        h.update(f"package:{_package_digest()}\n".encode())
        for p in self.passes:  # built-in passes are in the package digest; user passes are not
            h.update(f"{p.name}:{pass_uuid(p)}\n".encode())
        h.update(repr(self.pass_names).encode())
        h.update(spec_table_key(self.specs).encode())
        for name in sorted(self.stamps):
            st = self.stamps[name]
            h.update(
                f"\n{name}:{st.kernel}:{st.arch}:{st.kv_in_place}:{st.fp8_output}:"
                f"{st.fp8_output_tensor_scale}".encode()
            )
        return h.hexdigest()

    def uuid(self) -> str:
        """Hash of pass sources, options and the per-layer spec table (stable across processes)."""
        return self._uuid

    def __call__(self, graph: fx.Graph) -> None:
        start = time.perf_counter()
        graph_id = report.next_graph_id()
        dump = PassDumper(self.dump_dir, graph_id) if self.dump_dir is not None else None
        ctx = PassContext(stamps=self.stamps)
        ops_before = count_ops(graph)
        stats: dict[str, report.PassStats] = {}
        for p in self.passes:
            if dump is not None:
                dump.before(p.name, graph)
            ctx.decisions = {}
            t0 = time.perf_counter()
            matches = p(graph, ctx)
            stats[p.name] = report.PassStats(
                p.name,
                matches,
                time.perf_counter() - t0,
                dict(ctx.decisions),
                fusion=p.fusion,
                writes_stamps=p.writes_stamps,
            )
            if dump is not None:
                dump.after(p.name, graph)
        layers = {
            name: stamp_row(st)
            for name, st in sorted(self.stamps.items(), key=lambda kv: kv[1].spec.index)
            if any(name in s.decisions for s in stats.values())
        }
        rep = report.GraphReport(
            graph_id=graph_id,
            layers=layers,
            per_pass=stats,
            ops_before=ops_before,
            ops_after=count_ops(graph),
            time_s=0.0,
            dump_dir=str(dump.folder) if dump is not None else None,
        )
        rep.time_s = time.perf_counter() - start - (dump.seconds if dump is not None else 0.0)
        if dump is not None:
            dump.report(rep)
        self.runs += 1
        self.last = rep
        report.record(rep)
        logger.info(rep.summary())


def stamp_row(st: KVQStamp) -> dict[str, object]:
    """A layer's row of the pass report: its mode, kernel, arch and index."""
    return {
        "mode": st.spec.mode.value,
        "kernel": st.kernel,
        "arch": st.arch,
        "index": st.spec.index,
    }


def resolve_passes(passes: Sequence[str | KVQPass]) -> tuple[KVQPass, ...]:
    """Pass names (``PASSES``) and ``KVQPass`` objects -> pass objects, checked: known names,
    each pass once, a pass that reads the stamps after one that writes them."""
    if isinstance(passes, str):
        raise ValueError(f"passes must be a sequence of pass names, got the string {passes!r}")
    unknown = [p for p in passes if isinstance(p, str) and p not in PASSES]
    if unknown:
        raise ValueError(f"unknown passes {unknown}; known passes: {list(PASSES)}")
    for p in passes:
        if not isinstance(p, str) and not (
            isinstance(p, KVQPass) and isinstance(getattr(p, "name", None), str) and p.name
        ):
            hint = " (a class: pass an instance)" if isinstance(p, type) else ""
            raise ValueError(
                f"passes must be pass names or KVQPass objects (instances of a KVQPass subclass "
                f"with a name), got {p!r}{hint}"
            )
    objs = tuple(PASSES[p]() if isinstance(p, str) else p for p in passes)
    names = [p.name for p in objs]
    if len(set(names)) != len(names):
        raise ValueError(f"passes lists a pass twice: {names}")
    first_writer = next((i for i, p in enumerate(objs) if p.writes_stamps), len(objs))
    readers = [p.name for p in objs[:first_writer] if p.reads_stamps]
    if readers:
        raise ValueError(
            f"passes {names}: the fusions read the stamps, so 'annotate' must run before them "
            f"(before {readers})"
        )
    return objs


def pass_uuid(p: KVQPass) -> str:
    """``p.uuid()``, refused when it is empty (Inductor's FX graph cache would be keyed on
    nothing that says what the pass does)."""
    key = p.uuid()
    if not key or not isinstance(key, str):
        raise ValueError(
            f"pass {p.name!r}: uuid() returned {key!r}; it must return a non-empty string that "
            "changes whenever the pass does (it keys Inductor's FX graph cache)"
        )
    return key
