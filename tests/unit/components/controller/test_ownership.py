"""One writer per table: the controller's modules read each other's tables but write only their
own. Walks the package's source with `ast` and fails on a write (an assignment, `+=`, `del`, a
mutating method call) to a table from a module that is not its owner.

The owners below are mirrored in docs/architecture.md ("Who writes which table"); a change to
one is a change to the other.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import hicache.components.controller as package
from hicache.components.controller.rows import RequestState
from hicache.components.controller.shared import Counters

PACKAGE = Path(package.__file__).parent

# The request table: its rows (`RequestState`) are named `state` wherever they are handled.
REQUESTS = "requests"
REQUEST_FIELDS = frozenset(f.name for f in dataclasses.fields(RequestState))

# The radix tree's mutating calls (structure, locks, protection, copies, recency, marks).
TREE = "tiers"
TREE_MUTATORS = frozenset(
    {
        "match",  # recency, splits at the matched boundary
        "insert",
        "insert_host",
        "retain",
        "mark_pins",
        "unmark_pins",
        "begin_backup",
        "end_backup",
        "commit_load_back",
        "revert_load_back",
        "drop_host",
        "drop_host_copies",
        "lock",
        "unlock",
        "protect_host",
        "release_host",
        "set_page_hashes",
        "evict_device",
        "evict_host",
        "discard_device",
        "clear",
    }
)

# The two slot ledgers (`Tiers.ledgers[tier]`).
LEDGERS = "tiers"
LEDGER_MUTATORS = frozenset({"alloc", "free", "lease"})

# Each counter has one writer: the module that does what it counts.
COUNTERS = {
    "device_hit_tokens": "requests",
    "host_hit_tokens": "loads",
    "h2d_bytes": "loads",
    "storage_hit_tokens": "prefetches",
    "anchor_backups": "prefetches",
    "device_evictions": "tiers",
    "host_evictions": "tiers",
    "d2h_bytes": "writes",
    "evict_backups": "writes",
    "skipped_uploads": "writes",
    "upload_timeouts": "writes",
    "storage_dropped": "writes",  # through `Counters.dropped`
    "abandoned_ops": "controller",
}

# The op table's, the flows' and the controller's own tables, by attribute: written through
# `self` by their owner only (others ask: `of`, `in_flight`, `busy`, `pending`, `tickets`,
# `poll`; the op table's rows change through its `start` / `finish`).
TABLES = {
    "ops": {"_rows", "_views", "_credits", "_arrived", "_reports", "_fired"},
    "writes": {"write_backlog", "upload_backlog"},
    "prefetches": {"by_rid", "host_waiting", "tokens"},
    "pins": {"entries", "_by_head", "_next_expiry"},
    "requests": {"table"},
    "storage_switch": {"calls", "on", "_detaching"},
    "controller": {
        "_calls",
        "_parked",
        "_flush_waiters",
        "_clear_waiters",
        "_drain_waiters",
        "_between",
    },
}

MUTATING_METHODS = frozenset(
    {
        "append",
        "appendleft",
        "extend",
        "insert",
        "pop",
        "popleft",
        "popitem",
        "remove",
        "clear",
        "add",
        "discard",
        "update",
        "setdefault",
        "sort",
        "reverse",
    }
)


def _chain(node: ast.expr) -> tuple[str, list[str]] | None:
    """`a.b[i].c` -> ("a", ["b", "c"]): the root name and the attributes on the way, or None
    for anything not rooted at a name (a call's result, a literal)."""
    attrs: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Name):
            return node.id, attrs[::-1]
        else:
            return None


def _writes(tree: ast.AST) -> Iterator[tuple[int, str, ast.expr, str | None]]:
    """(line, kind, what is written, the method called) for every write in a module."""
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, (ast.Attribute, ast.Subscript)):
                    yield node.lineno, "store", t, None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node.lineno, "call", node.func.value, node.func.attr


def _violations(module: str, source: str) -> Iterator[str]:
    tree = ast.parse(source)
    for line, kind, target, method in _writes(tree):
        chain = _chain(target)
        if chain is None:
            continue
        root, attrs = chain
        where = f"{module}.py:{line}"
        # the radix tree: `tree.M(...)`, `x.tree.M(...)`
        if (
            kind == "call"
            and method in TREE_MUTATORS
            and (root == "tree" or attrs[-1:] == ["tree"])
        ):
            if module != TREE:
                yield f"{where}: the radix tree's {method}() is {TREE}.py's to call"
            continue
        # a ledger: `x.ledgers[tier].M(...)`
        if kind == "call" and method in LEDGER_MUTATORS and attrs[-1:] == ["ledgers"]:
            if module != LEDGERS:
                yield f"{where}: ledger {method}() is {LEDGERS}.py's to call"
            continue
        # a counter: `x.counters.F += ...`, `x.counters.dropped(...)`
        if "counters" in attrs or root == "counters":
            rest = attrs[attrs.index("counters") + 1 :] if "counters" in attrs else attrs
            name = "storage_dropped" if kind == "call" and method == "dropped" else rest[:1]
            field = name if isinstance(name, str) else (name[0] if name else None)
            if field in COUNTERS and COUNTERS[field] != module:
                yield f"{where}: counter {field} is {COUNTERS[field]}.py's to write"
            continue
        if kind == "call" and method not in MUTATING_METHODS:
            continue
        # a request's row: `state.F = ...`, `state.F.append(...)`
        if root == "state":
            if module != REQUESTS and (not attrs or attrs[0] in REQUEST_FIELDS):
                yield f"{where}: a request's state is {REQUESTS}.py's to write"
            continue
        # `self.NAME` is the module's own; a table reached through another object
        # (`self._writes.upload_backlog`, `prefetches.by_rid`) is its owner's alone
        for name in attrs[1:] if root == "self" else attrs:
            owners = {m for m, names in TABLES.items() if name in names}
            if owners and module not in owners:
                yield f"{where}: {name} is {'/'.join(sorted(owners))}.py's to write"


def _modules() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(PACKAGE.glob("*.py"))}


def test_every_table_is_written_by_its_owner_only() -> None:
    found = [v for module, source in _modules().items() for v in _violations(module, source)]
    assert not found, "writes to another module's table:\n" + "\n".join(found)


def test_the_owners_named_here_exist() -> None:
    """The table above names real modules and real counters (a rename updates it)."""
    modules = set(_modules())
    named = {REQUESTS, TREE, LEDGERS, *COUNTERS.values(), *TABLES}
    assert named <= modules, named - modules
    assert set(COUNTERS) == {f.name for f in dataclasses.fields(Counters)}


def test_a_foreign_write_is_caught() -> None:
    """The walk itself: each kind of foreign write in a module that does not own it."""
    source = """
def f(self, state, tree, step):
    state.prefix_slots = 1
    state.loads.append(2)
    self._shared.tree.lock(3)
    self._tiers.ledgers["host"].free(4)
    self._shared.counters.h2d_bytes += 5
    self._writes.upload_backlog.clear()
    prefetches.by_rid[6] = 7
    self._ops._rows["backup"].pop(8)
"""
    found = list(_violations("elsewhere", source))
    assert len(found) == 8, found
    assert not list(_violations("requests", "def f(state):\n    state.host_len = 0\n"))
