"""SlotLedger: page-aligned allocation, free, counts, and errors that change nothing."""

import numpy as np
import pytest

from hicache.components.allocator.core import LedgerError, SlotLedger


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
