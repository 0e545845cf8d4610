"""Layers point one way: the import graph of `hicache/`, read with `ast` (nothing is imported).

What counts as an import of module A by module B:
- every `import`/`from ... import` of a hicache module in B, at module level, inside class
  bodies, `if`/`try`/`with` blocks, inside `if TYPE_CHECKING:` (a type-only import is still a
  dependency a reader and a type checker follow) and inside function bodies (a deferred import
  is still a dependency: deferring is for optional or heavy third-party packages -- torch,
  cuda-python, triton, prometheus, zmq -- or the hicache modules that load them, never a way
  around a rule);
- `from P import name` depends on `P` (its `__init__`) and, where `P.name` is a module, on that
  module. A package's `__init__` running before its submodules is not counted as an edge.

Rules:
- `LAYERS` below assigns every hicache module a layer, and every import goes to the same or a
  lower layer; a new package or top-level module must be placed in the table;
- `WITHIN_A_LAYER`: the few imports the table allows that are still wrong;
- whatever order the table takes, some packages stay strictly apart (the radix core below the
  data plane, the data plane below storage, storage below the runtime, the test kit below the
  CLI, ...: `test_the_table_keeps_these_apart`);
- no cycle among hicache modules, counting module-level and type-only imports (an import in a
  function body runs after every module has loaded, so it cannot take part in an import cycle);
- `hicache.config` stays cheap to import: what its module-level imports load (package
  `__init__`s included, the top-level `hicache` facade excepted) imports no torch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

# Lowest first: (layer, its members, why it sits there). A module belongs to the member that is
# the longest prefix of its dotted name; it may import its own layer and the layers below.
LAYERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        "vocabulary",
        ("hicache.types", "hicache.data"),
        "ids, the empty slot array and the packaged trace: what every layer may name",
    ),
    (
        "core",
        ("hicache.policies", "hicache.radix"),
        (
            "the cache's pure decisions: the policies, and the radix tree with its keys and page "
            "hashes; plain values in and out, no torch, no native code, no I/O"
        ),
    ),
    (
        "data plane",
        ("hicache.kernels",),
        (
            "pools, copies and transfer streams (torch, the compiled copiers); knows nothing of the "
            "cache above it, so the core's decisions never wait on it to import or build"
        ),
    ),
    (
        "configuration",
        ("hicache.config", "hicache.sizing", "hicache.secrets", "hicache.seal"),
        (
            "what an instance is told and checked against: config validates names the core and the "
            "data plane own; secrets, and the seal a secret derives; sizing's arithmetic"
        ),
    ),
    (
        "observability",
        ("hicache.observability",),
        "events, metrics and KV events: read configs and tree facts, drive nothing",
    ),
    (
        "storage",
        ("hicache.backends",),
        "L3 stores and their keys; no actors, so engine integrations use them alone",
    ),
    (
        "runtime",
        ("hicache.runtime",),
        "actors, mailboxes, replies and the clock: generic machinery that stamps events",
    ),
    (
        "protocol",
        ("hicache.results", "hicache.messages"),
        (
            "what crosses the actors' and the API's boundaries: results carry load handles, "
            "messages carry replies, backends and load handles"
        ),
    ),
    (
        "components",
        ("hicache.components",),
        "the actors and the controller: cores and stores driven by messages",
    ),
    ("assembly", ("hicache.assembly",), "builds and wires the components for one config"),
    ("cache", ("hicache.cache",), "the HiCache facade over the assembled actors"),
    (
        "public API",
        ("hicache", "hicache.hybrid"),
        "the package's re-exports, and hybrid models' caches made of several caches",
    ),
    (
        "users",
        ("hicache.integrations", "hicache.testing"),
        "engines' adapters and the test kit: they use the public API and what it stands on",
    ),
    ("commands", ("hicache.cli",), "the CLI: may use everything, the test kit included"),
)

# Imports the table allows that are still wrong: (importer, imported, why).
WITHIN_A_LAYER: tuple[tuple[str, str, str], ...] = (
    ("hicache.sizing", "hicache.config", "sizing is arithmetic on numbers; callers word errors"),
    ("hicache.secrets", "hicache", "secrets is the standard library alone: all others use it"),
    ("hicache.seal", "hicache", "the seal is hashlib/hmac (and cryptography): a plain value"),
    ("hicache.types", "hicache", "ids name things; they import none of them"),
)

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


def _layer_of(name: str) -> int | None:
    """Index in LAYERS of the member that is the longest prefix of `name` (None: unplaced)."""
    best: tuple[int, int] | None = None
    for index, (_layer, members, _why) in enumerate(LAYERS):
        for member in members:
            if _within(name, member) and (best is None or len(member) > best[0]):
                best = (len(member), index)
    return None if best is None else best[1]


ALL_KINDS = ("module", "typing", "function")


def test_every_module_has_a_layer():
    members = [m for _layer, ms, _why in LAYERS for m in ms]
    assert len(members) == len(set(members)), "a member listed twice"
    assert not [m for m in members if m not in MODULES], "a member that is not a module"
    assert [name for name in MODULES if _layer_of(name) is None] == []


def test_imports_go_to_the_same_or_a_lower_layer():
    upward = {
        name: [
            f"{target} ({LAYERS[_layer_of(target) or 0][0]})"
            for target in sorted(_edges(name, ALL_KINDS))
            if (_layer_of(target) or 0) > (_layer_of(name) or 0)
        ]
        for name in MODULES
    }
    assert {name: up for name, up in upward.items() if up} == {}


@pytest.mark.parametrize("importer, imported, why", WITHIN_A_LAYER)
def test_within_a_layer(importer, imported, why):
    bad = {
        name: sorted(t for t in _edges(name, ALL_KINDS) if _within(t, imported))
        for name in MODULES
        if _within(name, importer)
    }
    assert {name: targets for name, targets in bad.items() if targets} == {}, why


@pytest.mark.parametrize(
    "lower, higher",
    [
        ("hicache.radix", "hicache.kernels"),  # the tree needs no native code
        ("hicache.kernels", "hicache.backends"),  # the data plane knows nothing of storage
        ("hicache.config", "hicache.backends"),
        ("hicache.observability", "hicache.runtime"),
        ("hicache.backends", "hicache.runtime"),  # stores are usable without actors
        ("hicache.cache", "hicache.hybrid"),  # nothing below the cache knows hybrid models
        ("hicache.testing", "hicache.cli"),  # the test kit does not need the CLI
    ],
)
def test_the_table_keeps_these_apart(lower, higher):
    assert (_layer_of(lower) or 0) < (_layer_of(higher) or 0)


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
