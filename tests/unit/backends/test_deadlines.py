"""The stores' expiry deadlines: due keys come out soonest first, once; a key given another
deadline or dropped leaves only a stale row, and rewrites do not grow the heap."""

from __future__ import annotations

from hicache.backends.deadlines import Deadlines


def test_due_keys_come_out_soonest_first_and_once():
    d = Deadlines()
    d.set("b", 20.0)
    d.set("a", 10.0)
    d.set("c", 30.0)
    d.set("c", 5.0)  # moved earlier: its old row is stale
    d.drop("b")
    assert d.due(25.0) == ["c", "a"]
    assert d.due(100.0) == [] and len(d) == 0


def test_rewrites_keep_the_rows_bounded():
    d = Deadlines()
    for i in range(10_000):
        d.set(f"k{i % 10}", float(i))
    assert len(d) == 10 and d.rows() <= 2 * 10 + 64
    assert sorted(d.due(1e9)) == sorted(f"k{i}" for i in range(10))
