"""``KVQPassManager``: runs the kvq passes as Inductor's ``post_grad_custom_post_pass``.

Install it yourself with ``torch._inductor.config.patch(post_grad_custom_post_pass=manager)``
or let ``kvq_backend`` do it. It owns what is common to all passes: the per-layer stamps (spec +
kernel capability decisions), timing, per-pass decisions, the report, the log line, and the
before/after dumps. Its ``uuid()`` hashes the pass sources, the options and the per-layer spec
table, so Inductor's FX graph cache never reuses a graph compiled for another skip config.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from torch_kvq.attention.kernels import capabilities as caps
from torch_kvq.passes import common, report
from torch_kvq.passes.annotate import AnnotatePass
from torch_kvq.passes.base import KVQPass, PassContext
from torch_kvq.passes.cleanup import CleanupPass
from torch_kvq.passes.fuse_attention_output_quant import FuseAttentionOutputQuantPass
from torch_kvq.passes.fuse_dequant_attention import FuseDequantAttentionPass
from torch_kvq.passes.fuse_quant_cache_write import FuseQuantCacheWritePass
from torch_kvq.passes.graph_utils import count_ops
from torch_kvq.passes.stamp import KVQStamp
from torch_kvq.spec import LayerKVSpec, spec_table_key

logger = logging.getLogger("torch_kvq")

PASSES: dict[str, type] = {
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


def make_stamp(spec: LayerKVSpec, kernel: str, arch: str) -> KVQStamp:
    """The stamp of one layer: its spec plus what its kernel on ``arch`` can do for it, from the
    capability table the kernel's own ``check_supported`` reads (ValueError: unknown kernel, or
    an arch it has no row for)."""
    q = spec.model_dtype
    limit = caps.layer_limit(kernel, arch, spec)
    fp8_kv = (
        spec.is_quantized and limit is None and caps.supports(kernel, arch, spec.mode, q, False)
    )
    fp8_out = fp8_kv and caps.supports(kernel, arch, spec.mode, q, True)
    fp8_out_t = fp8_out and caps.supports_tensor_output_scale(kernel, arch)
    return KVQStamp(
        spec,
        kernel,
        arch,
        fp8_kv=fp8_kv,
        fp8_output=fp8_out,
        limit=limit,
        fp8_output_tensor_scale=fp8_out_t,
    )


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


@cache
def _source_digest(module_name: str) -> str:
    return hashlib.sha256(inspect.getsource(sys.modules[module_name]).encode()).hexdigest()


# what the passes' decisions and rewrites depend on beyond the passes package itself
_DEPENDENCIES = ("spec.py", "attention/ops.py", "attention/kernels/capabilities.py")


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
        passes: pass names in order (default ``DEFAULT_PASSES``); fusions need ``annotate`` first.
        dump_dir: if set, write ``<dump_dir>/graph_NNN/<pass>.before.py`` / ``.after.py`` and
            ``report.txt`` per compiled graph.
    """

    def __init__(
        self,
        specs: Sequence[LayerKVSpec],
        *,
        kernel: str | Mapping[str, str] | None = None,
        arch: str | Mapping[str, str] = "cpu",
        passes: Sequence[str] = DEFAULT_PASSES,
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
        self.stamps: dict[str, KVQStamp] = {}
        for s in self.specs:
            a = archs[s.name] or "cpu"
            self.stamps[s.name] = make_stamp(s, kernels[s.name] or "reference", a)
        if isinstance(passes, str):
            raise ValueError(f"passes must be a sequence of pass names, got the string {passes!r}")
        unknown = [p for p in passes if p not in PASSES]
        if unknown:
            raise ValueError(f"unknown passes {unknown}; known passes: {list(PASSES)}")
        if len(set(passes)) != len(passes):
            raise ValueError(f"passes lists a pass twice: {list(passes)}")
        fusions = [p for p in passes if p.startswith("fuse_")]
        if fusions and (
            ("annotate" not in passes) or passes.index("annotate") > passes.index(fusions[0])
        ):
            raise ValueError(
                f"passes {list(passes)}: the fusions read the stamps, so 'annotate' must run before them"
            )
        self.pass_names = tuple(passes)
        self.passes: tuple[KVQPass, ...] = tuple(PASSES[p]() for p in passes)
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.runs = 0
        self.last: report.GraphReport | None = None
        self._uuid = self._compute_uuid()

    def _compute_uuid(self) -> str:
        h = hashlib.sha256(b"torch_kvq.passes/1")
        h.update(f"package:{_package_digest()}\n".encode())
        modules = {__name__, common.__name__, *(type(p).__module__ for p in self.passes)}
        for mod in sorted(modules):  # passes from outside the package (user pass objects)
            h.update(f"{mod}:{_source_digest(mod)}\n".encode())
        h.update(repr(self.pass_names).encode())
        h.update(spec_table_key(self.specs).encode())
        for name in sorted(self.stamps):
            st = self.stamps[name]
            h.update(
                f"\n{name}:{st.kernel}:{st.arch}:{st.fp8_kv}:{st.fp8_output}:"
                f"{st.fp8_output_tensor_scale}".encode()
            )
        return h.hexdigest()

    def uuid(self) -> str:
        """Hash of pass sources, options and the per-layer spec table (stable across processes)."""
        return self._uuid

    def __call__(self, graph: fx.Graph) -> None:
        start = time.perf_counter()
        graph_id = report.next_graph_id()
        dump = self._dump_folder(graph_id)
        ctx = PassContext(stamps=self.stamps)
        ops_before = count_ops(graph)
        stats: dict[str, report.PassStats] = {}
        dump_s = 0.0
        for p in self.passes:
            dump_s += _write(dump, f"{p.name}.before.py", graph)
            ctx.decisions = {}
            t0 = time.perf_counter()
            matches = p(graph, ctx)
            stats[p.name] = report.PassStats(
                p.name, matches, time.perf_counter() - t0, dict(ctx.decisions)
            )
            dump_s += _write(dump, f"{p.name}.after.py", graph)
            dump_s += _write_extras(dump, p.name, graph)
        layers = {
            name: {
                "mode": st.spec.mode.value,
                "kernel": st.kernel,
                "arch": st.arch,
                "index": st.spec.index,
            }
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
            dump_dir=str(dump) if dump is not None else None,
        )
        rep.time_s = time.perf_counter() - start - dump_s
        if dump is not None:
            (dump / "report.txt").write_text(rep.format() + "\n")
            (dump / "report.json").write_text(rep.to_json() + "\n")
        self.runs += 1
        self.last = rep
        report.record(rep)
        logger.info(rep.summary())

    def _dump_folder(self, graph_id: int) -> Path | None:
        if self.dump_dir is None:
            return None
        i = graph_id
        while (self.dump_dir / f"graph_{i:03d}").exists():
            i += 1
        folder = self.dump_dir / f"graph_{i:03d}"
        folder.mkdir(parents=True)
        return folder


def _write(folder: Path | None, name: str, graph: fx.Graph) -> float:
    """Write the readable code of ``graph`` to ``folder / name`` (if dumping); seconds spent."""
    if folder is None:
        return 0.0
    t0 = time.perf_counter()
    (folder / name).write_text(_graph_text(graph))
    return time.perf_counter() - t0


def _write_extras(folder: Path | None, name: str, graph: fx.Graph) -> float:
    """The diff and SVG picture beside a pass's dumps (see ``torch_kvq.debug.dump``); seconds."""
    if folder is None:
        return 0.0
    from torch_kvq.debug.dump import write_pass_extras

    t0 = time.perf_counter()
    write_pass_extras(folder, name, graph)
    return time.perf_counter() - t0


def _graph_text(graph: fx.Graph) -> str:
    gm = graph.owning_module
    if isinstance(gm, fx.GraphModule):
        return gm.print_readable(print_output=False)
    return str(graph)
