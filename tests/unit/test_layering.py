"""Layers point one way: the import graph of `hicache/`, read with `ast` (nothing is imported).

What counts as an import of module A by module B:
- every `import`/`from ... import` of a hicache module in B, at module level, inside class
  bodies, `if`/`try`/`with` blocks, and inside `if TYPE_CHECKING:` (a type-only import is still
  a dependency a reader and a type checker follow, and a cycle there is a cycle in the design);
- not an import inside a function body: it runs when the function is called, after every module
  has loaded (that is how optional or heavy dependencies -- torch.distributed, cuda-python,
  one stream kind -- stay off the import path), so it cannot take part in an import cycle. The
  layer rules below (kernels, testing) count those too: a deferred import is still a dependency.
- `from P import name` depends on `P` (its `__init__`) and, where `P.name` is a module, on that
  module. A package's `__init__` running before its submodules is not counted as an edge.

Rules: no cycle among hicache modules; nothing in `hicache.kernels` (the data plane) imports
`hicache.backends` (storage); nothing in `hicache.testing` imports `hicache.cli`; nothing below
the cache (components, kernels, backends, runtime) imports `hicache.hybrid`; and
`hicache.config` stays cheap to import: what its module-level imports load (package `__init__`s
included, the top-level `hicache` facade excepted) imports no torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hicache"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str) -> list[tuple[str, str]]:
    """(imported name, where) for every import statement in the module: where is "module",
    "typing" (under `if TYPE_CHECKING:`) or "function"."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str]] = []

    def visit(body: list[ast.stmt], where: str) -> None:
        for node in body:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, "typing" if where == "module" else where)
                visit(node.orelse, where)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, "function")
            elif isinstance(node, ast.Import):
                found.extend((alias.name, where) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.append((base, where))
                found.extend((f"{base}.{alias.name}", where) for alias in node.names)
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        visit([child], where)
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, field, None) or []:
                        if isinstance(child, ast.ExceptHandler):
                            visit(child.body, where)

    visit(ast.parse(path.read_text(), filename=str(path)).body, "module")
    return found


IMPORTS = {name: _imports(name) for name in MODULES}


def _hicache_targets(imported: str) -> set[str]:
    """The hicache modules an imported dotted name refers to (a module, or a name in one)."""
    while imported and imported not in MODULES:
        imported = imported.rpartition(".")[0]
    return {imported} if imported.startswith("hicache") else set()


def _edges(name: str, kinds: tuple[str, ...]) -> set[str]:
    out: set[str] = set()
    for imported, where in IMPORTS[name]:
        if where in kinds:
            out |= _hicache_targets(imported)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_parser_sees_the_package():
    assert "hicache.config" in MODULES and "hicache.radix.tree" in MODULES
    assert "hicache.radix.structure" in _edges("hicache.radix.tree", ("module",))
    assert "hicache.runtime.actor" in _edges("hicache.runtime.actor_system", ("module",))


def test_no_import_cycles():
    graph = {name: _edges(name, ("module", "typing")) for name in MODULES}
    cycles = _cycles(graph)
    detail = [[f"{a} -> {sorted(graph[a] & set(c))}" for a in c] for c in cycles]
    assert not cycles, detail


def _offenders(layer: str, forbidden: str) -> dict[str, list[str]]:
    out = {}
    for name in MODULES:
        if _within(name, layer):
            bad = sorted(
                {
                    imported
                    for imported, _ in IMPORTS[name]
                    if any(_within(t, forbidden) for t in _hicache_targets(imported))
                }
            )
            if bad:
                out[name] = bad
    return out


def test_the_data_plane_knows_nothing_of_storage():
    assert _offenders("hicache.kernels", "hicache.backends") == {}


def test_the_test_kit_does_not_import_the_cli():
    assert _offenders("hicache.testing", "hicache.cli") == {}


@pytest.mark.parametrize(
    "below", ["hicache.components", "hicache.kernels", "hicache.backends", "hicache.runtime"]
)
def test_nothing_below_the_cache_imports_the_hybrid_layer(below):
    assert _offenders(below, "hicache.hybrid") == {}


def test_config_imports_no_torch():
    """config.py validates names that the policy and data-plane registries own; reading them must
    not load torch (hicache/kernels/names.py, the policies) so the configuration stays cheap."""
    seen: set[str] = set()
    todo = ["hicache.config"]
    while todo:
        name = todo.pop()
        if name in seen or name == "hicache":
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [
            ".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) in MODULES
        ]
        todo += sorted(_edges(name, ("module",)))
    assert "hicache.kernels.names" in seen and "hicache.policies.eviction" in seen
    heavy = {
        name: imported
        for name in seen
        for imported, where in IMPORTS[name]
        if where == "module" and imported.split(".")[0] == "torch"
    }
    assert heavy == {}, sorted(seen)


def test_the_lazy_data_plane_exports_what_it_loads():
    """`hicache.kernels` loads its names on first use (PEP 562); its `__all__` is spelt out so
    that linters and type checkers see the exports, and must name exactly what it can load."""
    import hicache.kernels as kernels

    assert sorted(kernels.__all__) == sorted(kernels._MODULE_OF)
    for name in kernels.__all__:
        assert getattr(kernels, name) is not None
