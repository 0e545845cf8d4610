"""SlotLedger: page-aligned allocation, free, counts, and errors that change nothing."""

import numpy as np
import pytest

from hicache.components.controller.ledger import LedgerError, SlotLedger


def snapshot(ledger):
    return (
        ledger.available,
        ledger.used,
        ledger._free_pages[: ledger._num_free].tolist(),
        ledger._held.tolist(),
    )


def test_alloc_hands_out_whole_pages_in_order_and_counts():
    ledger = SlotLedger(size=16, page_size=4, tier="device")
    a = ledger.alloc(8)
    assert a.tolist() == list(range(8))
    assert a.dtype == np.int64 and not a.flags.writeable
    assert (ledger.available, ledger.used) == (8, 8)
    b = ledger.alloc(8)
    assert b.tolist() == list(range(8, 16))
    assert ledger.alloc(4) is None
    ledger.check_integrity()


def test_alloc_more_than_available_returns_none_and_changes_nothing():
    ledger = SlotLedger(size=8, page_size=2, tier="host")
    ledger.alloc(4)
    before = snapshot(ledger)
    assert ledger.alloc(6) is None
    assert snapshot(ledger) == before


def test_free_then_alloc_reuses_the_same_pages_in_the_same_order():
    ledger = SlotLedger(size=12, page_size=2, tier="device")
    ledger.alloc(4)
    b = ledger.alloc(6)
    ledger.free(b)
    assert ledger.alloc(6).tolist() == b.tolist()
    ledger.check_integrity()


def test_free_accepts_pages_in_any_order():
    ledger = SlotLedger(size=8, page_size=2, tier="device")
    a = ledger.alloc(8)
    ledger.free(np.array([6, 7, 0, 1]))
    assert ledger.available == 4
    assert not ledger.is_held(np.array([0, 6])) and ledger.is_held(a[2:6])
    ledger.check_integrity()


@pytest.mark.parametrize(
    "slots, message",
    [
        ([0, 1, 0, 1], "double free"),
        ([8, 9], "foreign"),
        ([-2, -1], "foreign"),
        ([1, 2], "misaligned"),
        ([0, 1, 2], "not a multiple"),
        ([4, 5], "not held"),
    ],
)
def test_bad_free_raises_and_changes_nothing(slots, message):
    ledger = SlotLedger(size=8, page_size=2, tier="host")
    ledger.alloc(4)
    before = snapshot(ledger)
    with pytest.raises(LedgerError, match=message) as info:
        ledger.free(np.array(slots))
    assert "host ledger" in str(info.value)
    assert snapshot(ledger) == before


def test_double_free_across_calls_raises():
    ledger = SlotLedger(size=4, page_size=1, tier="device")
    a = ledger.alloc(2)
    ledger.free(a)
    with pytest.raises(LedgerError, match="not held"):
        ledger.free(a)
    ledger.check_integrity()


def test_partly_bad_free_changes_nothing():
    ledger = SlotLedger(size=8, page_size=2, tier="device")
    ledger.alloc(4)
    before = snapshot(ledger)
    with pytest.raises(LedgerError):
        ledger.free(np.array([0, 1, 4, 5]))  # first page held, second not
    assert snapshot(ledger) == before


@pytest.mark.parametrize("size, page_size", [(10, 4), (-4, 4), (8, 0)])
def test_bad_geometry_is_rejected(size, page_size):
    with pytest.raises(LedgerError):
        SlotLedger(size=size, page_size=page_size, tier="device")


def test_misaligned_alloc_is_rejected():
    ledger = SlotLedger(size=8, page_size=4, tier="device")
    with pytest.raises(LedgerError, match="multiple of page_size=4"):
        ledger.alloc(3)
    assert ledger.available == 8


def test_integrity_check_catches_a_corrupted_ledger():
    ledger = SlotLedger(size=8, page_size=2, tier="device")
    ledger.alloc(2)
    ledger._held[3] = True  # a page both free and held
    with pytest.raises(AssertionError):
        ledger.check_integrity()


# ---------------------------------------------------------------- leasing: the ledger grows


def test_a_ledger_starts_with_what_is_leased_and_grows_by_lease():
    ledger = SlotLedger(size=16, page_size=4, tier="host", leased=4)
    assert (ledger.size, ledger.capacity, ledger.available, ledger.used) == (4, 16, 4, 0)
    a = ledger.alloc(4)
    assert a.tolist() == [0, 1, 2, 3]
    assert ledger.alloc(4) is None  # slots 4.. exist but are not leased yet
    ledger.lease(8, 16)
    ledger.check_integrity()
    assert (ledger.size, ledger.available, ledger.used) == (12, 8, 4)
    assert ledger.alloc(8).tolist() == list(range(8, 16))  # the lowest new page first
    ledger.lease(4, 8)
    assert ledger.alloc(4).tolist() == [4, 5, 6, 7]
    assert (ledger.size, ledger.available, ledger.used) == (16, 0, 16)
    ledger.free(a)
    ledger.check_integrity()
    assert ledger.available == 4


def test_slots_not_leased_cannot_be_freed():
    ledger = SlotLedger(size=16, page_size=4, tier="host", leased=4)
    with pytest.raises(LedgerError, match="not held"):
        ledger.free(np.arange(8, 12))
    ledger.check_integrity()


@pytest.mark.parametrize(
    ("start", "stop", "message"),
    [
        (2, 8, "misaligned"),  # not a page boundary
        (4, 6, "misaligned"),
        (8, 4, "misaligned"),  # backwards
        (-4, 4, "out of range"),
        (12, 20, "out of range"),  # past the capacity
        (0, 8, "overlap"),  # [0, 4) is leased already
        (4, 12, "overlap"),  # [8, 12) too
    ],
)
def test_bad_lease_raises_and_changes_nothing(start, stop, message):
    ledger = SlotLedger(size=16, page_size=4, tier="host", leased=4)
    ledger.lease(8, 12)
    held = ledger.alloc(4)
    before = (snapshot(ledger), ledger._leased.tolist(), ledger.size)
    with pytest.raises(LedgerError, match=message):
        ledger.lease(start, stop)
    assert (snapshot(ledger), ledger._leased.tolist(), ledger.size) == before
    ledger.check_integrity()
    ledger.free(held)


def test_an_empty_lease_changes_nothing():
    ledger = SlotLedger(size=8, page_size=4, tier="host", leased=0)
    ledger.lease(4, 4)
    assert (ledger.size, ledger.available) == (0, 0)
    ledger.check_integrity()


def test_integrity_check_catches_a_free_page_that_is_not_leased():
    ledger = SlotLedger(size=8, page_size=2, tier="host", leased=4)
    ledger._free_pages[ledger._num_free] = 3  # pushed without a lease
    ledger._num_free += 1
    with pytest.raises(AssertionError):
        ledger.check_integrity()


@pytest.mark.parametrize("seed", range(8))
def test_compiled_and_numpy_ledgers_agree(seed, monkeypatch):
    """The same random allocs and frees (bad ones included: a page twice, a page not held,
    a misaligned page) on a ledger with the compiled passes and on one without give the same
    slots, the same errors and the same state."""
    import hicache.components.controller.ledger as ledger_module

    rng = np.random.default_rng(seed)
    ps = int(rng.choice([1, 4, 16]))
    compiled = SlotLedger(size=64 * ps, page_size=ps, tier="device")
    held: list[np.ndarray] = []
    script = []
    for _ in range(200):
        if held and rng.random() < 0.45:
            slots = held.pop(int(rng.integers(len(held))))
            kind = rng.random()
            if kind < 0.1:  # a page listed twice
                slots = np.concatenate([slots, slots[:ps]])
            elif kind < 0.15 and ps > 1:  # a page shifted off its boundary
                slots = slots + 1
            elif kind < 0.2:  # freed again later
                held.append(slots)
            script.append(("free", slots))
            try:
                compiled.free(slots)
            except LedgerError:
                pass
        else:
            n = int(rng.integers(0, 12)) * ps
            script.append(("alloc", n))
            got = compiled.alloc(n)
            if got is not None:
                held.append(np.array(got))
    monkeypatch.setattr(ledger_module, "native_rows", lambda: None)
    plain = SlotLedger(size=64 * ps, page_size=ps, tier="device")
    replayed = SlotLedger(size=64 * ps, page_size=ps, tier="device")
    monkeypatch.undo()
    outcomes = {}
    for name, ledger, native in (("plain", plain, False), ("compiled", replayed, True)):
        if not native:
            monkeypatch.setattr(ledger_module, "native_rows", lambda: None)
        results = []
        for op, arg in script:
            if op == "alloc":
                got = ledger.alloc(arg)
                results.append(None if got is None else got.tolist())
            else:
                try:
                    ledger.free(arg)
                    results.append("freed")
                except LedgerError as exc:
                    results.append(str(exc))
            ledger.check_integrity()
        monkeypatch.undo()
        outcomes[name] = (results, snapshot(ledger))
    assert outcomes["plain"] == outcomes["compiled"]
    assert snapshot(compiled) == outcomes["compiled"][1]


@pytest.mark.parametrize("native", [True, False])
def test_free_parts_frees_all_or_nothing(native, monkeypatch):
    import hicache.components.controller.ledger as ledger_module

    if not native:
        monkeypatch.setattr(ledger_module, "native_rows", lambda: None)
    ledger = SlotLedger(size=16, page_size=2, tier="host")
    a, b = ledger.alloc(4), ledger.alloc(4)
    for bad, message in (
        ((a, np.array([12, 13])), "not held"),  # the second part was never allocated
        ((a, b[:2], a[2:]), "twice|not held"),  # a page in two parts
        ((b, np.array([1, 2])), "misaligned|not held"),
    ):
        before = snapshot(ledger)
        with pytest.raises(LedgerError, match=message):
            ledger.free_parts(bad)
        assert snapshot(ledger) == before
        ledger.check_integrity()
    joined = SlotLedger(size=16, page_size=2, tier="host")
    joined.alloc(8)
    joined.free(np.concatenate([b, a]))
    ledger.free_parts((b, a))
    assert snapshot(ledger) == snapshot(joined)
    ledger.free_parts(())
    assert snapshot(ledger) == snapshot(joined)
