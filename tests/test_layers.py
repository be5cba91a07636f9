"""Layers depend one way: spec -> attention -> passes / models -> debug, demo, integrations ->
cli. Every import in ``torch_kvq/`` (module level, in functions, under TYPE_CHECKING) is read
with ``ast``; no module may import one of a higher layer."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "torch_kvq"

# module prefix -> layer (the longest matching prefix wins); higher layers may import lower ones
LAYERS: dict[str, int] = {
    "torch_kvq.progress": 0,  # stderr progress lines; imports nothing of ours
    "torch_kvq.user_cache": 0,  # where fetched / converted files live; imports nothing of ours
    "torch_kvq.spec": 0,
    "torch_kvq.attention": 1,
    "torch_kvq.distributed": 1,  # tensor parallelism: shards, collectives, rank agreement
    "torch_kvq.passes": 2,
    "torch_kvq.models": 2,
    "torch_kvq.debug": 3,
    "torch_kvq.demo": 3,
    "torch_kvq.integrations": 3,
    "torch_kvq.evaluation": 3,  # trained-model accuracy: uses integrations, models, passes
    "torch_kvq.cli_args": 3,
    "torch_kvq.cli": 4,
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


def imports_of(path: Path, module: str) -> set[str]:
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # from pkg import module
    return {name for name in found if name.startswith("torch_kvq")}


def test_every_module_has_a_layer():
    modules = [module_name(p) for p in ROOT.rglob("*.py") if module_name(p) != "torch_kvq"]
    assert [m for m in modules if layer_of(m) is None] == []


def test_no_module_imports_a_higher_layer():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        if module == "torch_kvq":  # the package's lazy public names point at every layer
            continue
        own = layer_of(module)
        for imported in imports_of(path, module):
            other = layer_of(imported)
            if other is not None and own is not None and other > own:
                wrong.append(f"{module} (layer {own}) imports {imported} (layer {other})")
    assert wrong == []
