"""The package's imports point one way: no module imports, even from inside a function, a module that imports it back.

The graph is read from the source with `ast` (nothing is imported): every `import` and `from ... import` anywhere
in a module, at its top, inside a function or under `if TYPE_CHECKING`, relative imports resolved, is an edge to the
module it names (`from package import name` is an edge to `package.name` where that is a module, else to
`package`). The implicit import of a parent package is not an edge: every module would depend on the root.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hf_depthgrow"



def module_files(package: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's `__init__`)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _imported_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(package: Path = PACKAGE) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """`(edges, names)`: each module's set of imported package modules, and every `(importer, module, name)`
    of a `from ... import name` that names no module."""
    modules = module_files(package)
    edges: dict[str, set[str]] = {}
    names = []
    for module, (path, is_package) in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                source = _imported_from(module, is_package, node)
                if source not in modules:
                    continue
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:
                        found.add(f"{source}.{alias.name}")
                    else:
                        found.add(source)
                        names.append((module, source, alias.name))
        found.discard(module)
        edges[module] = found
    return edges, names


@functools.lru_cache(maxsize=1)
def _package_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    return import_graph()


def cycles(edges: dict[str, set[str]]) -> list[tuple[frozenset[str], list[str]]]:
    """Each strongly connected component of more than one module, with one shortest cycle through it (sorted)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v):  # Tarjan's algorithm; the graph has a few hundred nodes, far below the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return sorted(((frozenset(c), _shortest_cycle(edges, c)) for c in components), key=lambda found: found[1])


def _shortest_cycle(edges: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    came_from, frontier = {start: None}, [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(edges[v] & component):
                if w == start:
                    path = [v]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a strongly connected component always has one


def _unit(module: str) -> str:
    """The subpackage or top-level module a module belongs to (`hf_depthgrow.growth.engine` -> `hf_depthgrow.growth`)."""
    return ".".join(module.split(".")[:2])


def _shown(found: tuple[frozenset[str], list[str]]) -> str:
    component, cycle = found
    more = f" (one of the cycles among {len(component)} modules)" if len(component) > len(cycle) - 1 else ""
    return " -> ".join(m.removeprefix("hf_depthgrow.") for m in cycle) + more


def test_no_import_cycle():
    found = cycles(_package_graph()[0])
    assert not found, "import cycles (function-level imports count):\n" + "\n".join(map(_shown, found))


def test_subpackages_import_each_other_one_way():
    edges, _ = _package_graph()
    units: dict[str, set[str]] = {}
    for module, targets in edges.items():
        units.setdefault(_unit(module), set()).update(_unit(t) for t in targets if _unit(t) != _unit(module))
    found = cycles(units)
    assert not found, "subpackages that import each other:\n" + "\n".join(map(_shown, found))


def test_no_private_name_crosses_a_subpackage():
    _, names = _package_graph()
    crossing = sorted(
        f"{importer} imports {name} from {source}"
        for importer, source, name in names
        if name.startswith("_") and not name.startswith("__") and _unit(importer) != _unit(source)
    )
    assert not crossing, "private names imported across subpackages (make them public where they live):\n" + "\n".join(crossing)


@pytest.mark.parametrize("init", sorted(PACKAGE.glob("*/__init__.py")), ids=lambda p: p.parent.name)
def test_a_subpackage_docstring_that_lists_its_modules_lists_them_all(init):
    """A module list in an `__init__` docstring is true: once it names modules of its folder, it names every one."""
    folder = init.parent
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    named = set(re.findall(r"`(\w+)`", ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or "")) & modules
    if named:
        assert named == modules, f"{folder.name}/__init__.py names {sorted(named)} but not {sorted(modules - named)}"


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    """The checks above fail on what they are meant to catch: a cycle closed by a function-level relative import,
    a `from package import module` edge, and a private name taken from another subpackage."""
    root = tmp_path / "hf_depthgrow"
    for folder in (root, root / "a", root / "b"):
        folder.mkdir(exist_ok=True)
        (folder / "__init__.py").write_text("")
    (root / "a" / "one.py").write_text("from ..b.two import _hidden\n")
    (root / "b" / "two.py").write_text("def f():\n    from ..a import one\n\n_hidden = 1\n")
    edges, names = import_graph(root)
    assert edges["hf_depthgrow.a.one"] == {"hf_depthgrow.b.two"} and edges["hf_depthgrow.b.two"] == {"hf_depthgrow.a.one"}
    assert [_shown(c) for c in cycles(edges)] == ["a.one -> b.two -> a.one"]
    assert cycles(edges)[0][0] == {"hf_depthgrow.a.one", "hf_depthgrow.b.two"}
    assert ("hf_depthgrow.a.one", "hf_depthgrow.b.two", "_hidden") in names
