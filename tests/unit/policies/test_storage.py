"""L3 admission and eviction policies (`hicache/policies/storage.py`) and `StoreBook`, the
cap rule every capped store and the sweep's model of L3 share."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.policies.storage import (
    DEFAULT_STORE_POLICY,
    GHOST_FLOOR,
    STORE_POLICIES,
    LruStore,
    S3FifoStore,
    SecondHitStore,
    StoreBook,
    TinyLfuStore,
    make_store_policy,
)

NAMES = sorted(STORE_POLICIES)

# One step: (operation, key number, size).
OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "touch", "missed", "remove", "pop", "admit"]),
        st.integers(0, 40),
        st.integers(1, 50),
    ),
    max_size=300,
)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_the_book_is_what_was_inserted_and_not_yet_given_up(name, ops):
    policy = make_store_policy(name)
    held: dict[str, int] = {}
    for op, n, size in ops:
        key = f"k{n}"
        if op == "insert":
            policy.insert(key, size)
            held[key] = size
        elif op == "touch":
            policy.touch(key)
        elif op == "missed" and key not in held:
            policy.missed(key)
        elif op == "admit" and key not in held:
            assert policy.admit(key, size) in (True, False)
        elif op == "remove":
            assert policy.remove(key) == held.pop(key, 0)
        elif op == "pop":
            victim = policy.pop_victim()
            if held:
                assert victim is not None and held.pop(victim[0]) == victim[1]
            else:
                assert victim is None
        assert policy.held_bytes == sum(held.values())
        assert len(policy) == len(held)
        assert {k for k in (f"k{i}" for i in range(41)) if k in policy} == set(held)
        assert sorted(policy.keys()) == sorted(held)
        policy.check_integrity()  # type: ignore[attr-defined]
    given_up = []
    while (victim := policy.pop_victim()) is not None:
        given_up.append(victim)
        policy.check_integrity()  # type: ignore[attr-defined]
    assert sorted(given_up) == sorted(held.items())
    assert policy.held_bytes == 0 and len(policy) == 0


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["write", "read", "probe", "remove"]), st.integers(0, 60)),
        max_size=300,
    ),
    cap=st.integers(1, 400),
)
def test_a_book_never_holds_more_than_its_cap(name, ops, cap):
    book = StoreBook(name, cap)
    held: set[str] = set()
    for op, n in ops:
        key, size = f"k{n}", 7 + n % 5 * 20  # a few sizes, some larger than a small cap
        if op == "write":
            before = set(held)
            evicted = book.write(key, size)
            if evicted is None:
                assert size > cap or key not in before
                assert held == before  # a refused write changes nothing held
            else:
                assert set(evicted) <= before and key not in evicted
                held = (before - set(evicted)) | {key}
        elif op == "read":
            assert book.read(key) == (key in held)
        elif op == "probe":
            assert book.probe(key) == (key in held)
        else:
            assert (book.remove(key) > 0) == (key in held)
            held.discard(key)
        assert book.held_bytes <= cap
        assert {k for k in (f"k{i}" for i in range(61)) if k in book} == held
        book.policy.check_integrity()  # type: ignore[attr-defined]


def test_ghost_lists_and_the_sketch_stay_bounded_by_what_is_held():
    """Thousands of distinct keys through a store of 10 values: what the policies remember
    of keys they do not hold stays at the floor, not the keys ever seen."""
    for name in NAMES:
        book = StoreBook(name, 10)
        for n in range(20 * GHOST_FLOOR):
            book.probe(f"m{n}")
            book.write(f"w{n}", 1)
            book.write(f"w{n}", 1)
        policy = book.policy
        policy.check_integrity()  # type: ignore[attr-defined]
        ghost = getattr(policy, "_ghost", None) or getattr(policy, "_seen", None)
        if ghost is not None:
            assert len(ghost) == GHOST_FLOOR
        sketch = getattr(policy, "_sketch", None)
        if sketch is not None:
            assert sketch.width == GHOST_FLOOR


def test_lru_gives_up_the_least_recently_used():
    book = StoreBook(LruStore(), 3)
    for k in "abc":
        assert book.write(k, 1) == []
    assert book.read("a")
    assert book.write("d", 1) == ["b"]
    assert book.write("e", 2) == ["c", "a"]
    assert book.write("big", 4) is None  # larger than the whole cap


def test_s3fifo_evicts_values_never_read_before_those_read_and_remembers_them():
    book = StoreBook(S3FifoStore(), 10)
    for n in range(10):
        book.write(f"k{n}", 1)
    for n in range(5):
        book.read(f"k{n}")  # read while in the small FIFO: these move to main
    evicted = []
    for n in range(10, 15):
        evicted += book.write(f"k{n}", 1) or []
    assert evicted == [f"k{n}" for n in range(5, 10)]
    # A key evicted recently comes back to the main FIFO: the next victims are new ones.
    assert book.write("k5", 1) == ["k10"]
    policy = book.policy
    assert isinstance(policy, S3FifoStore) and "k5" in policy._main


def test_second_hit_takes_a_value_that_would_evict_only_on_its_second_offer():
    book = StoreBook(SecondHitStore(), 2)
    assert book.write("a", 1) == [] and book.write("b", 1) == []  # room: no admission asked
    assert book.write("c", 1) is None and book.refused == 1
    assert book.write("c", 1) == ["a"]
    assert not book.probe("d")  # a miss counts as the first offer
    assert book.write("d", 1) == ["b"]
    assert book.write("b", 1) == ["c"]  # evicted keys are remembered too


def test_tinylfu_takes_a_value_only_when_more_frequent_than_the_victim():
    book = StoreBook(TinyLfuStore(), 2)
    book.write("a", 1)
    book.write("b", 1)
    for _ in range(3):
        assert book.read("a") and book.read("b")
    assert book.write("c", 1) is None  # once seen, against "a" read three times
    for _ in range(4):
        book.probe("c")
    assert book.write("c", 1) == ["a"]


@pytest.mark.parametrize("cap", [0, -1, 1.5, True])
def test_bad_caps_and_names_are_clear_errors(cap):
    with pytest.raises(ValueError, match="capacity_bytes must be a positive int"):
        StoreBook("lru", cap)
    with pytest.raises(ValueError, match=r"unknown store policy 'mru'; known: lru, s3fifo"):
        make_store_policy("mru")
    assert DEFAULT_STORE_POLICY in STORE_POLICIES
