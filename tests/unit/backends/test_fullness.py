"""The write gate of a store that said "full": closed for a backoff that doubles while the
store stays full, one streak reported, calls in flight not doubling it, reset on a landing."""

from __future__ import annotations

import errno

from hicache.backends.fullness import FIRST_BACKOFF, LONGEST_BACKOFF, WriteGate, is_full_error


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_while_full_and_resets_on_a_landed_write():
    clock = Clock()
    gate = WriteGate(clock)
    assert gate.is_open()
    assert gate.full() is True  # a streak begins: the caller reports it
    assert not gate.is_open()
    assert gate.full() is False  # a call that was in flight answers full too: no change
    clock.now += FIRST_BACKOFF
    assert gate.is_open()
    assert gate.full() is False  # still full after the backoff: the same streak, twice as long
    clock.now += FIRST_BACKOFF
    assert not gate.is_open()
    clock.now += FIRST_BACKOFF
    assert gate.is_open()
    assert gate.landed() is True  # a write landed: the streak ends
    assert gate.landed() is False
    assert gate.full() is True and gate.streaks == 2 and gate.full_answers == 4


def test_the_backoff_is_bounded():
    clock = Clock()
    gate = WriteGate(clock)
    for _ in range(40):
        gate.full()
        clock.now += LONGEST_BACKOFF
        assert gate.is_open()  # never closed longer than the longest backoff
    assert gate.streaks == 1


def test_no_space_errors_are_full_others_are_not():
    assert is_full_error(OSError(errno.ENOSPC, "No space left on device"))
    assert is_full_error(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_full_error(OSError(errno.EIO, "I/O error"))
    assert not is_full_error(ValueError("no"))
