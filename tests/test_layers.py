"""Layers depend one way: spec -> attention -> passes / models -> debug, integrations -> cli, and
no module of torch_kvq takes part in an import cycle.

Every import in ``torch_kvq/`` (module level, in functions, under TYPE_CHECKING) is read with
``ast``: no module may import one of a higher layer, and the module import graph has no cycle but
the pairs in ``TYPE_ONLY_CYCLES``, where the import back exists for annotations only.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "torch_kvq"

# module prefix -> layer (the longest matching prefix wins); higher layers may import lower ones
LAYERS: dict[str, int] = {
    "torch_kvq.progress": 0,  # stderr progress lines; imports nothing of ours
    "torch_kvq.user_cache": 0,  # where fetched / converted files live; imports nothing of ours
    "torch_kvq.spec": 0,
    "torch_kvq.spec_modes": 0,  # the KV-cache modes and their kv_cache_dtype strings (torch only)
    "torch_kvq.spec_channels": 0,  # K channel scales as the spec holds them (imports nothing of ours)
    "torch_kvq.spec_resolve": 0,  # KVCacheConfig + layers -> LayerKVSpecs (spec's types)
    "torch_kvq.spec_table": 0,  # the spec table and its notes (spec's LayerKVSpec)
    "torch_kvq.kv_presets": 0,  # named KV configs (spec's KVCacheConfig)
    "torch_kvq.attention": 1,
    "torch_kvq.distributed": 1,  # tensor parallelism: shards, collectives, rank agreement
    "torch_kvq.passes": 2,
    "torch_kvq.models": 2,
    "torch_kvq.debug": 3,  # library code the commands print: plans, dump index, accuracy math
    "torch_kvq.integrations": 3,
    "torch_kvq.evaluation": 3,  # trained-model accuracy: uses integrations, models, passes
    "torch_kvq.cli": 4,  # the kvq command: the top floor, nothing imports it
}

# (a, b): a imports b at run time, b imports a only under ``if TYPE_CHECKING:`` (to annotate).
TYPE_ONLY_CYCLES: dict[tuple[str, str], str] = {
    ("torch_kvq.attention.context", "torch_kvq.attention.kernels.base"): (
        "the kernel interface annotates the ForwardContext its calls receive"
    ),
    ("torch_kvq.attention.layer", "torch_kvq.attention.registry"): (
        "the registry annotates the Attention layers it holds"
    ),
    ("torch_kvq.integrations.transformers", "torch_kvq.integrations.hf_generate"): (
        "the paged HF cache annotates the KVQCausalLM it serves"
    ),
}


def layer_of(module: str) -> int | None:
    best = None
    for prefix, layer in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best[0])
        ):
            best = (prefix, layer)
    return None if best is None else best[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: frozenset[str] = frozenset(module_name(p) for p in ROOT.rglob("*.py"))


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks (not their ``else``)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def imports_of(path: Path, module: str) -> dict[str, bool]:
    """The torch_kvq names ``module`` imports -> True when every such import is under
    ``if TYPE_CHECKING:``. ``from pkg import name`` imports ``pkg.name`` when that is a module of
    ours, else ``pkg``."""
    found: dict[str, bool] = {}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    type_only = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for name in names:
            if name.startswith("torch_kvq") and name != module:
                found[name] = found.get(name, True) and id(node) in type_only
    return found


def import_graph() -> dict[str, dict[str, bool]]:
    """module -> {module of ours it imports -> type-only}."""
    graph: dict[str, dict[str, bool]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        graph[module] = {m: t for m, t in imports_of(path, module).items() if m in MODULES}
    return graph


def cycles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "torch_kvq" and layer_of(m) is None] == []


def test_no_module_imports_a_higher_layer():
    wrong = []
    for module, imported in sorted(import_graph().items()):
        if module == "torch_kvq":  # the package's lazy public names point at every layer
            continue
        own = layer_of(module)
        for name in sorted(imported):
            other = layer_of(name)
            if other is not None and own is not None and other > own:
                wrong.append(f"{module} (layer {own}) imports {name} (layer {other})")
    assert wrong == []


def test_no_import_cycle_but_the_named_type_only_pairs():
    graph = import_graph()
    for (a, b), why in TYPE_ONLY_CYCLES.items():
        assert why and b in graph.get(a, {}), f"{a} no longer imports {b}: drop the entry"
        assert a in graph.get(b, {}), f"{b} no longer imports {a}: drop the entry"
        assert not graph[a][b], f"{a} imports {b} only for annotations: not a cycle at run time"
        assert graph[b][a], f"{b} imports {a} at run time: a real cycle, not a type-only pair"
        graph[b] = {m: t for m, t in graph[b].items() if m != a}
    found = [
        [f"{m} -> {n}" + (" (TYPE_CHECKING)" if t else "") for m in c for n, t in graph[m].items()
         if n in c]
        for c in cycles(graph)
    ]  # fmt: skip
    assert found == []


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b": False}, "b": {"c": True}, "c": {"a": False}, "d": {"a": False}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b": False}, "b": {}}) == []
