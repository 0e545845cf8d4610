"""Which values a store at its cap takes and keeps: the L3 admission and eviction policies.

A policy is pure bookkeeping over keys and sizes (no I/O, no clock): the store tells it what
it wrote, read, missed and removed, asks it whether to take a value it does not hold
(`admit`) and, when it needs room, which value goes next (`pop_victim`, one at a time, so
freeing room costs O(values removed)). `StoreBook` joins a policy to a byte cap: the rule
"a write that does not fit asks for admission, then evicts victims until it fits" lives there
once. The memory store and the sizing sweep's model of L3 both run a `StoreBook`, so the
sweep predicts what a capped memory store keeps (and what any store keeps that runs its
policy through a `StoreBook` with the same calls).

The policies (docs/benchmarks.md, "L3 admission and eviction" has their hit rates):
- `lru`: least recently used goes first; every write is taken.
- `s3fifo` (the default, `DEFAULT_STORE_POLICY`): S3-FIFO (Yang et al., SOSP 2023): new values enter a small FIFO; those read
  while there move to the main FIFO, the others leave and are remembered in a ghost list, so
  a value written again soon after enters the main FIFO directly. The main FIFO gives a value
  read since its last pass another pass (up to 3). One-time values leave quickly.
- `second-hit`: LRU behind a doorkeeper: a value that would evict others is taken only if its
  key was offered, missed or evicted recently (remembered in a bounded ghost list).
- `tinylfu`: LRU behind a frequency filter (TinyLFU, Einziger et al. 2017): a count-min sketch
  of recent offers, reads and misses; a value that would evict others is taken only if its key
  is at least as frequent as the value it would evict first.

Every call is O(1) amortised; remembered keys (ghost lists) and the sketch are bounded by a
multiple of the values held (with a small floor), never by the keys ever seen.

Not thread-safe: the store that owns a policy serialises calls (under its own lock).
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Protocol

__all__ = [
    "DEFAULT_STORE_POLICY",
    "STORE_POLICIES",
    "LruStore",
    "S3FifoStore",
    "SecondHitStore",
    "StoreBook",
    "StorePolicy",
    "TinyLfuStore",
    "make_store_policy",
]

GHOST_FLOOR = 1024
"""The fewest keys a ghost list may remember, however few values are held (a store that has
just opened still learns which keys come back)."""


class StorePolicy(Protocol):
    """The store's book of the values it holds, in the order it would give them up."""

    name: str

    @property
    def held_bytes(self) -> int:
        """Bytes of the values held (as given to `insert`)."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    def keys(self) -> Iterator[str]:
        """The keys held, in no promised order (a rescan compares them with the disk)."""
        ...

    def admit(self, key: str, size: int) -> bool:
        """Whether a write of `key` (not held) that would evict others should be stored. Asked
        once per such write (`StoreBook.write`), not for writes that fit: a filter may count
        the offer, but what is held does not change; a refused key may be admitted later."""
        ...

    def insert(self, key: str, size: int) -> None:
        """`key` was written and is held now (again, if it was: its size is replaced)."""
        ...

    def touch(self, key: str) -> None:
        """A held `key` was read (ignored for a key not held)."""
        ...

    def missed(self, key: str) -> None:
        """A read or probe did not find `key` (admission policies remember it)."""
        ...

    def remove(self, key: str) -> int:
        """`key` is gone (deleted, expired, corrupt); its size, 0 if it was not held."""
        ...

    def pop_victim(self) -> tuple[str, int] | None:
        """The next value to give up, removed from the book: (key, size); None when empty."""
        ...


class _Ghost:
    """Keys remembered in arrival order, at most `limit()` of them (oldest forgotten first)."""

    __slots__ = ("_keys", "_limit")

    def __init__(self, limit: Callable[[], int]) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._limit = limit

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def add(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        self.trim()

    def discard(self, key: str) -> bool:
        """Forget `key`: whether it was remembered."""
        if key in self._keys:
            del self._keys[key]
            return True
        return False

    def trim(self) -> None:
        """Forget the oldest keys beyond the limit (amortised O(1): each key leaves once)."""
        limit = self._limit()
        while len(self._keys) > limit:
            self._keys.popitem(last=False)


class LruStore:
    """Least recently used (read or written) goes first; every write is admitted."""

    name = "lru"
    __slots__ = ("_held", "_order")

    def __init__(self) -> None:
        self._order: OrderedDict[str, int] = OrderedDict()
        self._held = 0

    @property
    def held_bytes(self) -> int:
        return self._held

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def keys(self) -> Iterator[str]:
        return iter(self._order)

    def admit(self, key: str, size: int) -> bool:
        return True

    def insert(self, key: str, size: int) -> None:
        old = self._order.pop(key, None)
        self._held += size - (old or 0)
        self._order[key] = size

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def missed(self, key: str) -> None:
        return None

    def remove(self, key: str) -> int:
        size = self._order.pop(key, None)
        if size is None:
            return 0
        self._held -= size
        return size

    def pop_victim(self) -> tuple[str, int] | None:
        if not self._order:
            return None
        key, size = self._order.popitem(last=False)
        self._held -= size
        return key, size

    def peek_victim(self) -> str | None:
        """The key `pop_victim` would give up next (None when empty); changes nothing."""
        return next(iter(self._order), None)

    def check_integrity(self) -> None:
        assert self._held == sum(self._order.values()), "held bytes drifted"


class SecondHitStore(LruStore):
    """LRU behind a doorkeeper: a write that would evict others is taken only when its key is
    remembered (offered before, missed by a read or probe, or evicted); otherwise the key is
    remembered and the write refused. The ghost list holds at most as many keys as values
    held (`GHOST_FLOOR` at least), forgetting the oldest."""

    name = "second-hit"
    __slots__ = ("_seen",)

    def __init__(self) -> None:
        super().__init__()
        self._seen = _Ghost(lambda: max(len(self._order), GHOST_FLOOR))

    def admit(self, key: str, size: int) -> bool:
        if self._seen.discard(key):
            return True
        self._seen.add(key)
        return False

    def missed(self, key: str) -> None:
        self._seen.add(key)

    def check_integrity(self) -> None:
        super().check_integrity()
        assert len(self._seen) <= max(len(self._order), GHOST_FLOOR), "ghost list unbounded"

    def remove(self, key: str) -> int:
        size = super().remove(key)
        self._seen.trim()
        return size

    def pop_victim(self) -> tuple[str, int] | None:
        victim = super().pop_victim()
        if victim is not None:
            self._seen.add(victim[0])
        return victim


class _CountMin:
    """A count-min sketch of 4-bit counters (4 rows) with aging: after `10 x width` counts
    every counter is halved, so old popularity fades (O(width) every 10 x width counts)."""

    __slots__ = ("_additions", "_counts", "_mask")

    ROWS = 4
    MAX = 15

    def __init__(self, width: int) -> None:
        size = 1 << max(4, (width - 1).bit_length())  # a power of two, 16 at least
        self._mask = size - 1
        self._counts = bytearray(size * self.ROWS)
        self._additions = 0

    @property
    def width(self) -> int:
        return self._mask + 1

    def _cells(self, key: str) -> list[int]:
        # Two independent 32-bit hashes of the key, combined per row (Kirsch-Mitzenmacher);
        # deterministic across processes, unlike hash(str).
        data = key.encode()
        h1 = zlib.crc32(data)
        h2 = zlib.adler32(data) | 1
        width = self._mask + 1
        return [row * width + ((h1 + row * h2) & self._mask) for row in range(self.ROWS)]

    def add(self, key: str) -> None:
        counts = self._counts
        for cell in self._cells(key):
            if counts[cell] < self.MAX:
                counts[cell] += 1
        self._additions += 1
        if self._additions >= 10 * self.width:
            self._counts = bytearray(c >> 1 for c in counts)
            self._additions //= 2

    def estimate(self, key: str) -> int:
        counts = self._counts
        return min(counts[cell] for cell in self._cells(key))


class TinyLfuStore(LruStore):
    """LRU behind a frequency filter (TinyLFU): offers, reads and misses are counted in a
    count-min sketch; a write that would evict others is taken only when its key's count
    is at least that of the value LRU would evict first (ties taken: on the shipped trace
    that did better at every cap measured than TinyLFU's strict "above"). The sketch has 4 rows of 4 to 16
    counters per value held (`GHOST_FLOOR` at least), rebuilt empty when it is resized."""

    name = "tinylfu"
    __slots__ = ("_sketch",)

    def __init__(self) -> None:
        super().__init__()
        self._sketch = _CountMin(GHOST_FLOOR)

    def _fit_sketch(self) -> None:
        """Between 1/16 and 1/4 of a counter row per value held (`GHOST_FLOOR` at least):
        doubled or halved, empty, when the held values leave that range (amortised O(1))."""
        width, held = self._sketch.width, len(self._order)
        if held * 4 > width:
            self._sketch = _CountMin(width * 2)
        elif held * 16 < width and width > GHOST_FLOOR:
            self._sketch = _CountMin(max(GHOST_FLOOR, width // 2))

    def _count(self, key: str) -> None:
        self._fit_sketch()
        self._sketch.add(key)

    def admit(self, key: str, size: int) -> bool:
        self._count(key)
        victim = self.peek_victim()
        return victim is None or self._sketch.estimate(key) >= self._sketch.estimate(victim)

    def touch(self, key: str) -> None:
        if key in self._order:
            self._count(key)
            self._order.move_to_end(key)

    def missed(self, key: str) -> None:
        self._count(key)

    def remove(self, key: str) -> int:
        size = super().remove(key)
        self._fit_sketch()
        return size

    def pop_victim(self) -> tuple[str, int] | None:
        victim = super().pop_victim()
        self._fit_sketch()
        return victim

    def check_integrity(self) -> None:
        super().check_integrity()
        assert self._sketch.width <= max(16 * len(self._order), GHOST_FLOOR), "sketch unbounded"


class S3FifoStore:
    """S3-FIFO: a small FIFO (a tenth of the bytes held) takes new values; on leaving it a
    value read while there moves to the main FIFO, any other is evicted and its key kept in
    a ghost list (as many keys as values held, `GHOST_FLOOR` at least). A write whose key is
    in the ghost list goes to the main FIFO directly. The main FIFO evicts its oldest value
    unless it was read since its last pass, which then goes round again with one read fewer
    (reads counted up to 3). Every write is admitted."""

    name = "s3fifo"
    __slots__ = ("_ghost", "_main", "_main_bytes", "_reads", "_small", "_small_bytes")

    SMALL_SHARE = 0.1
    MAX_READS = 3

    def __init__(self) -> None:
        self._small: OrderedDict[str, int] = OrderedDict()  # key -> size, oldest first
        self._main: OrderedDict[str, int] = OrderedDict()
        self._small_bytes = 0
        self._main_bytes = 0
        self._reads: dict[str, int] = {}  # held key -> reads since insert or last pass (<= 3)
        self._ghost = _Ghost(lambda: max(len(self._reads), GHOST_FLOOR))

    @property
    def held_bytes(self) -> int:
        return self._small_bytes + self._main_bytes

    def __len__(self) -> int:
        return len(self._reads)

    def __contains__(self, key: object) -> bool:
        return key in self._reads

    def keys(self) -> Iterator[str]:
        return iter(self._reads)

    def admit(self, key: str, size: int) -> bool:
        return True

    def insert(self, key: str, size: int) -> None:
        if key in self._small:
            self._small_bytes += size - self._small[key]
            self._small[key] = size
        elif key in self._main:
            self._main_bytes += size - self._main[key]
            self._main[key] = size
        elif self._ghost.discard(key):
            self._main[key] = size
            self._main_bytes += size
            self._reads[key] = 0
        else:
            self._small[key] = size
            self._small_bytes += size
            self._reads[key] = 0

    def touch(self, key: str) -> None:
        reads = self._reads.get(key)
        if reads is not None and reads < self.MAX_READS:
            self._reads[key] = reads + 1

    def missed(self, key: str) -> None:
        return None

    def remove(self, key: str) -> int:
        if self._reads.pop(key, None) is None:
            return 0
        size = self._small.pop(key, None)
        if size is not None:
            self._small_bytes -= size
            self._ghost.trim()
            return size
        size = self._main.pop(key)
        self._main_bytes -= size
        self._ghost.trim()
        return size

    def pop_victim(self) -> tuple[str, int] | None:
        # Each value moves from small to main at most once, and goes round main at most
        # MAX_READS times per read counted: O(1) amortised per call.
        while self._reads:
            if self._small and (
                not self._main or self._small_bytes >= self.SMALL_SHARE * self.held_bytes
            ):
                key, size = self._small.popitem(last=False)
                self._small_bytes -= size
                if self._reads[key] > 0:
                    self._reads[key] = 0
                    self._main[key] = size
                    self._main_bytes += size
                    continue
                del self._reads[key]
                self._ghost.add(key)
                return key, size
            key, size = self._main.popitem(last=False)
            reads = self._reads[key]
            if reads > 0:
                self._reads[key] = reads - 1
                self._main[key] = size
                continue
            self._main_bytes -= size
            del self._reads[key]
            self._ghost.trim()
            return key, size
        return None

    def check_integrity(self) -> None:
        assert self._small_bytes == sum(self._small.values()), "small FIFO bytes drifted"
        assert self._main_bytes == sum(self._main.values()), "main FIFO bytes drifted"
        assert self._small.keys().isdisjoint(self._main.keys()), "a key in both FIFOs"
        assert set(self._reads) == set(self._small) | set(self._main), "read counts drifted"
        assert all(0 <= r <= self.MAX_READS for r in self._reads.values()), "read count range"
        assert len(self._ghost) <= max(len(self._reads), GHOST_FLOOR), "ghost list unbounded"
        assert not any(k in self._ghost for k in self._reads), "a held key is a ghost"


class StoreBook:
    """A capped store's accounting: a policy and a byte cap (None: no cap), and the rule that
    joins them. A write that fits is taken; one that would not fit is offered to the policy
    (`admit`), and if taken, the policy's victims are evicted until it fits. A value larger
    than the cap is never taken. Pure (no I/O): the caller does what the answers say, e.g.
    deletes the evicted keys' values. A store should answer a refused write as a set that
    succeeded and kept nothing (the memory store does): a failed set is retried by the
    uploader, and the second offer would undo the refusal."""

    __slots__ = ("capacity_bytes", "evictions", "policy", "refused")

    def __init__(self, policy: StorePolicy | str, capacity_bytes: int | None) -> None:
        if isinstance(policy, str):
            policy = make_store_policy(policy)
        if capacity_bytes is not None and (
            isinstance(capacity_bytes, bool)
            or not isinstance(capacity_bytes, int)
            or capacity_bytes <= 0
        ):
            raise ValueError(
                f"capacity_bytes must be a positive int or None, got {capacity_bytes!r}"
            )
        self.policy = policy
        self.capacity_bytes = capacity_bytes
        self.evictions = 0  # values given up to make room
        self.refused = 0  # writes the policy did not admit

    @property
    def held_bytes(self) -> int:
        return self.policy.held_bytes

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, key: object) -> bool:
        return key in self.policy

    def fits(self, size: int) -> bool:
        """Whether a value of `size` bytes fits beside what is held, evicting nothing."""
        cap = self.capacity_bytes
        return cap is None or self.policy.held_bytes + size <= cap

    def write(self, key: str, size: int) -> list[str] | None:
        """Take `key` (`size` bytes; a held key's old value is replaced): the keys evicted
        to make room, in order; None when it is not stored (larger than the cap, or not
        admitted), and then nothing changed but what the policy remembers of the offer."""
        cap = self.capacity_bytes
        policy = self.policy
        if cap is not None and size > cap:
            return None
        replaced = key in policy
        if replaced:
            policy.remove(key)
        evicted: list[str] = []
        if not self.fits(size):
            if not replaced and not policy.admit(key, size):
                self.refused += 1
                return None
            while not self.fits(size):
                victim = policy.pop_victim()
                if victim is None:  # pragma: no cover - held_bytes drifted from the values
                    raise AssertionError(f"{policy.name}: over its cap with nothing held")
                evicted.append(victim[0])
            self.evictions += len(evicted)
        policy.insert(key, size)
        return evicted

    def write_fitting(self, entries: Iterable[tuple[str, int]]) -> int:
        """`write` of each (key, size), in order, for a batch whose sizes together fit beside
        what is held (the caller checked `fits`): nothing is offered or evicted, so each write
        is a replace and an insert. The most bytes held on the way."""
        policy = self.policy
        held = peak = policy.held_bytes
        for key, size in entries:
            if key in policy:
                held -= policy.remove(key)
            policy.insert(key, size)
            held += size
            if held > peak:
                peak = held
        return peak

    def read(self, key: str) -> bool:
        """A read of `key`: whether it is held (touched if so, missed if not)."""
        if key in self.policy:
            self.policy.touch(key)
            return True
        self.policy.missed(key)
        return False

    def probe(self, key: str) -> bool:
        """Whether `key` is held, without reading it (missed if not)."""
        if key in self.policy:
            return True
        self.policy.missed(key)
        return False

    def remove(self, key: str) -> int:
        """`key` is gone: its size, 0 if it was not held."""
        return self.policy.remove(key)


STORE_POLICIES: Mapping[str, Callable[[], StorePolicy]] = MappingProxyType(
    {
        "lru": LruStore,
        "s3fifo": S3FifoStore,
        "second-hit": SecondHitStore,
        "tinylfu": TinyLfuStore,
    }
)
DEFAULT_STORE_POLICY = "s3fifo"
"""Chosen by measurement (bench/l3_policies.py; docs/benchmarks.md, "L3 admission and
eviction"): on the shipped trace the only policy at or above LRU's L3 hit rate at every cap
measured (1/10, 1/4 and 1/2 of the working set), and the best on their average."""


def make_store_policy(name: str) -> StorePolicy:
    """A fresh policy by name (ValueError naming the known ones for another)."""
    try:
        factory = STORE_POLICIES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown store policy {name!r}; known: {', '.join(sorted(STORE_POLICIES))}"
        ) from None
    return factory()
