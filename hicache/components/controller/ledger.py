"""Slot ledgers: which token slots of one KV pool (device or host) are free. The controller's
tier owner (`tiers.py`) holds the two of record, one per tier.

A ledger knows nothing about what a slot holds; it only records ownership. Slots are ints in
``[0, capacity)``, handed out and taken back in whole pages (``page_size`` consecutive slots
starting at a multiple of ``page_size``). A slot is usable once it is *leased* (`lease`: the
allocator has prepared its memory); a leased slot is either free (on the ledger's free stack) or
held by a caller, never both: ``available + used == size`` (the leased slots) at all times.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hicache.kernels.native.addresses import flat
from hicache.kernels.native.rowcopy import native_rows

__all__ = ["LedgerError", "SlotLedger"]


class LedgerError(ValueError):
    """A ledger call with bad input (double free, foreign slot, misaligned size). Nothing changed."""


class SlotLedger:
    """Page-granular slot ownership for one tier. Deterministic: the same calls give the same slots.

    Invariants (checked by :meth:`check_integrity`):
    - each leased page is either on the free stack exactly once, or marked held; a page not
      leased is neither;
    - ``available`` (free tokens) + ``used`` (held tokens) == ``size`` (leased tokens).
    Owner: exactly one actor (the tree's controller); everyone else holds the slot arrays it
    returned.
    """

    __slots__ = (
        "size",
        "capacity",
        "page_size",
        "tier",
        "_free_pages",
        "_num_free",
        "_held",
        "_leased",
        "_page_offsets",
        "_mark",
    )

    def __init__(self, *, size: int, page_size: int, tier: str, leased: int | None = None) -> None:
        """`size` slots in all; the first `leased` of them (None: all) usable now, the rest
        once `lease` adds them."""
        if page_size < 1:
            raise LedgerError(f"{tier} ledger: page_size must be >= 1, got {page_size}")
        if size < 0 or size % page_size:
            raise LedgerError(
                f"{tier} ledger: size must be a non-negative multiple of page_size={page_size}, got {size}"
            )
        self.capacity = size
        self.size = 0  # leased tokens: grows with `lease`
        self.page_size = page_size
        self.tier = tier
        num_pages = size // page_size
        # Stack of free page numbers; the top is the end.
        self._free_pages: npt.NDArray[np.int64] = np.zeros(num_pages, dtype=np.int64)
        self._num_free = 0
        self._held = np.zeros(num_pages, dtype=bool)
        self._leased = np.zeros(num_pages, dtype=bool)
        self._page_offsets = np.arange(page_size, dtype=np.int64)
        self._mark = np.zeros(num_pages, dtype=np.int64)  # scratch for the duplicate check in free
        self.lease(0, size if leased is None else leased)

    def lease(self, start: int, stop: int) -> None:
        """Make slots ``[start, stop)`` usable: whole pages, none leased before, inside the
        capacity. They go on top of the free stack, so the next alloc hands out ``start`` first.
        Mutates; raises LedgerError, changing nothing, on bad input."""
        ps = self.page_size
        if not (0 <= start <= stop <= self.capacity) or start % ps or stop % ps:
            raise LedgerError(
                f"{self.tier} ledger: lease of [{start}, {stop}) is not a range of whole pages "
                f"(page_size={ps}) inside [0, {self.capacity}) (misaligned or out of range)"
            )
        first, last = start // ps, stop // ps
        if self._leased[first:last].any():
            page = first + int(np.argmax(self._leased[first:last]))
            raise LedgerError(
                f"{self.tier} ledger: lease of [{start}, {stop}) overlaps slot {page * ps}, "
                "leased already (overlap)"
            )
        self._leased[first:last] = True
        top = self._num_free
        # Reversed so the lowest new page is on top: a fresh ledger hands out 0, 1, ...
        self._free_pages[top : top + last - first] = np.arange(last - 1, first - 1, -1)
        self._num_free = top + last - first
        self.size += stop - start

    @property
    def available(self) -> int:
        """Free tokens."""
        return self._num_free * self.page_size

    @property
    def used(self) -> int:
        """Held tokens."""
        return self.size - self.available

    def alloc(self, num_tokens: int) -> np.ndarray | None:
        """Take ``num_tokens`` slots (a multiple of page_size) as a read-only int64 array of whole pages.

        Returns None, changing nothing, when fewer than ``num_tokens`` slots are free. Mutates.
        """
        ps = self.page_size
        if num_tokens < 0 or num_tokens % ps:
            raise LedgerError(
                f"{self.tier} ledger: alloc of {num_tokens} tokens is not a non-negative multiple "
                f"of page_size={ps}"
            )
        num_pages = num_tokens // ps
        if num_pages > self._num_free:
            return None
        top = self._num_free
        native = native_rows()
        if native is not None:  # pop, mark and expand in one compiled pass
            out = native.ledger_alloc(self._free_pages, top, num_pages, ps, self._held)
            self._num_free = top - num_pages
            out.flags.writeable = False
            return out
        pages = self._free_pages[top - num_pages : top][::-1].copy()
        self._num_free = top - num_pages
        self._held[pages] = True
        slots: np.ndarray = (
            pages if ps == 1 else (pages[:, None] * ps + self._page_offsets).reshape(-1)
        )
        slots.flags.writeable = False
        return slots

    def free(self, slots: np.ndarray) -> None:
        """Return held slots (whole pages, any page order). Mutates.

        Raises LedgerError, changing nothing, if the length is not a multiple of page_size, a page is
        not a run of consecutive slots starting at a page boundary, a slot is outside ``[0, size)``,
        a page appears twice, or a page is not currently held (double free).
        """
        ps = self.page_size
        native = native_rows()
        if native is not None and flat(slots, np.int64):
            # Checks, held marks and the push in one compiled pass; a call it refuses goes on
            # below, where the checks name the problem.
            top = native.ledger_free(
                slots, ps, self.capacity, self._held, self._free_pages, self._num_free
            )
            if top >= 0:
                self._num_free = top
                return
        arr = np.asarray(slots)
        if arr.ndim != 1:
            raise LedgerError(
                f"{self.tier} ledger: slots must be one-dimensional, got shape {arr.shape}"
            )
        if arr.size == 0:
            return
        if arr.dtype.kind not in "iu":
            raise LedgerError(f"{self.tier} ledger: slots must be integers, got dtype {arr.dtype}")
        if arr.size % ps:
            raise LedgerError(
                f"{self.tier} ledger: free of {arr.size} slots is not a multiple of page_size={ps}"
            )
        arr = arr.astype(np.int64, copy=False)
        pages = self._checked_pages(arr)
        held = self._held[pages]
        if not held.all():
            bad_page = int(pages[np.argmin(held)])
            raise LedgerError(
                f"{self.tier} ledger: slot {bad_page * ps} is not held (double free or never allocated)"
            )
        self._held[pages] = False
        top = self._num_free
        # Pushed reversed so the next alloc hands the same pages back in the same order.
        self._free_pages[top : top + pages.size] = pages[::-1]
        self._num_free = top + pages.size

    def free_parts(self, parts: Sequence[np.ndarray]) -> None:
        """`free` of several slot arrays as one call (an eviction's victims, without joining
        them first): all of them, or on a LedgerError none."""
        if len(parts) == 1:
            self.free(parts[0])
            return
        native = native_rows()
        if native is not None and all(flat(part, np.int64) for part in parts):
            start = top = self._num_free
            for part in reversed(parts):  # the stack ends as `free` of the parts joined leaves it
                pushed = native.ledger_free(
                    part, self.page_size, self.capacity, self._held, self._free_pages, top
                )
                if pushed < 0:  # hold again what this call pushed; the join below names why
                    self._held[self._free_pages[start:top]] = True
                    break
                top = pushed
            else:
                self._num_free = top
                return
        if parts:
            self.free(np.concatenate(parts))

    def _checked_pages(self, arr: np.ndarray) -> np.ndarray:
        """The pages of int64 `arr` (a whole number of pages long), or the LedgerError naming
        why it is not a valid free: a slot out of range, a misaligned page, a page twice."""
        ps = self.page_size
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.capacity:
            bad = lo if lo < 0 else hi
            raise LedgerError(
                f"{self.tier} ledger: slot {bad} is outside [0, {self.capacity}) (foreign slot)"
            )
        if ps == 1:
            pages = arr
        else:
            rows = arr.reshape(-1, ps)
            pages = rows[:, 0] // ps
            if not np.array_equal(rows, pages[:, None] * ps + self._page_offsets):
                bad_row = int(
                    np.flatnonzero((rows != pages[:, None] * ps + self._page_offsets).any(1))[0]
                )
                raise LedgerError(
                    f"{self.tier} ledger: slots {rows[bad_row].tolist()} are not one aligned page "
                    f"of size {ps} (misaligned)"
                )
        # Duplicate check in O(n) without sorting: write each page's position, read it back; a page
        # listed twice reads back the later position at the earlier one.
        positions = np.arange(pages.size, dtype=np.int64)
        self._mark[pages] = positions
        if not np.array_equal(self._mark[pages], positions):
            raise LedgerError(
                f"{self.tier} ledger: a page is listed twice in one free call (double free)"
            )
        return pages

    def free_slots(self) -> np.ndarray:
        """Every free slot, as a new int64 array (pages in free-stack order). Does not mutate."""
        pages = self._free_pages[: self._num_free]
        if self.page_size == 1:
            return np.copy(pages)
        slots: np.ndarray = (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)
        return slots

    def is_held(self, slots: np.ndarray) -> bool:
        """True if every slot's page is currently held. Does not mutate."""
        arr = np.asarray(slots, dtype=np.int64)
        if arr.size == 0:
            return True
        if arr.min() < 0 or arr.max() >= self.capacity:
            return False
        return bool(self._held[arr // self.page_size].all())

    def check_integrity(self) -> None:
        """Raise AssertionError if the free stack, the held marks and the leased pages disagree.
        Does not mutate."""
        free = self._free_pages[: self._num_free]
        leased = int(self._leased.sum())
        assert leased * self.page_size == self.size, "leased pages != size"
        assert 0 <= self._num_free <= leased, "free count out of range"
        assert np.unique(free).size == free.size, "a page is on the free stack twice"
        assert not self._held[free].any(), "a page is both free and held"
        assert self._leased[free].all(), "a page not leased is free"
        assert not (self._held & ~self._leased).any(), "a page not leased is held"
        assert int(self._held.sum()) + self._num_free == leased, "free + held != leased"

    def __repr__(self) -> str:
        return (
            f"SlotLedger(tier={self.tier!r}, size={self.size}, capacity={self.capacity}, "
            f"page_size={self.page_size}, used={self.used})"
        )
