"""The import order of kvsession/__init__.py holds: no module imports from a layer above its own.

Every `import` and `from ... import` in the package is read with `ast` (those
inside functions too: a lazy import is still an arrow), resolved to the
top-level part it names (`kvsession.store.valkey` -> `store`) and compared
with the importing module's part in kvsession.LAYERS. An import under
`if TYPE_CHECKING:` is allowed upward: it names a type, it runs nothing.
Within one part, modules import each other freely; the server's and the
store's own orders are in their __init__ docstrings.
"""
from __future__ import annotations

import ast
from pathlib import Path

import kvsession

PACKAGE = Path(kvsession.__file__).parent


def _part(module: str) -> str:
    """The top-level part of a dotted name under kvsession ('' for the package itself)."""
    return module.split(".")[0]


def _layer_of() -> dict[str, int]:
    return {part: i for i, layer in enumerate(kvsession.LAYERS) for part in layer}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for inner in node.body:
                for n in ast.walk(inner):
                    out.add(id(n))
    return out


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported module under kvsession, type-only) of every kvsession import in a file."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    tree = ast.parse(path.read_text())
    typing_only = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join(base + (node.module.split(".") if node.module else []))
                names = [f"{target}.{a.name}" if target else a.name for a in node.names] if not node.module else [target]
            elif node.module and node.module.split(".")[0] == "kvsession":
                names = [node.module.partition(".")[2]]
            else:
                continue
            found += [(node.lineno, n, id(node) in typing_only) for n in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.partition(".")[2], id(node) in typing_only)
                      for a in node.names if a.name.split(".")[0] == "kvsession"]
    return found


def test_every_part_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())) and p.stem != "__init__"}
    assert parts - {"__main__"} == set(_layer_of()), "kvsession.LAYERS names every module and package once"


def test_no_module_imports_from_a_layer_above_its_own():
    layer = _layer_of()
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ("__init__.py", "__main__.py"):
            continue
        own = _part(".".join(rel.with_suffix("").parts))
        for line, target, typing_only in _imports(path):
            part = _part(target)
            if part == "" or part.startswith("_") or typing_only:
                continue
            if layer[part] > layer[own]:
                upward.append(f"{rel}:{line} ({own}, layer {layer[own]}) imports {target} (layer {layer[part]})")
    assert upward == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The walk above can fail: a kv module that imported the store would be reported."""
    fake = PACKAGE / "kv" / "_layers_probe.py"
    fake.write_text("from ..store import Store\n")
    try:
        imports = _imports(fake)
    finally:
        fake.unlink()
    assert imports == [(1, "store", False)]
    assert _layer_of()["store"] > _layer_of()["kv"]
