"""The controller's pin table: which token prefixes are pinned, in which tiers, until when.

A pin is kept here by its prefix (and salt), not only as marks on nodes, because pages come and
go: what is cached of the prefix is marked at `pin`, and pages of it that arrive later (a
request caches them, a prefetch brings them back from L3) are marked when they are inserted
(`after_insert`). `unpin` clears the marks along its prefix and marks again what the other pins
still cover. Expiry needs no timer: the marks compare with the clock, and expired entries leave
the table at the next pin, unpin or insert that meets them.

The tokens pinned per tier (the union of the prefixes, shared pages counted once) are capped:
a pin past the cap raises `PinLimitError` and changes nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache.components.controller.shared import Shared, Step
from hicache.components.controller.tiers import Tiers
from hicache.radix.results import TreeError
from hicache.radix.structure import INF
from hicache.results import InvalidRequest, PinLimitError, PinOutcome

PIN_TIERS = ("device", "host")


@dataclass(slots=True)
class PinEntry:
    tokens: Any  # the pinned prefix, whole pages, as the caller gave them
    device_until: float  # -INF: not pinned in L1
    host_until: float

    def until(self, tier: str) -> float:
        return self.device_until if tier == "device" else self.host_until

    def live(self, now: float) -> bool:
        return max(self.device_until, self.host_until) > now


Key = tuple[bytes, bytes]  # salt, the prefix's encoded bytes


class PinTable:
    def __init__(self, shared: Shared, tiers: Tiers) -> None:
        self._shared = shared
        self._tiers = tiers  # the tree's marks are the tier owner's to change
        self.entries: dict[Key, PinEntry] = {}
        self._by_head: dict[Key, set[bytes]] = {}  # (salt, first page) -> prefixes pinned
        self._next_expiry = INF  # the earliest end of a pin in the table

    def tables(self) -> dict[str, int]:
        return {"pins": len(self.entries)}

    def clear(self) -> None:
        """At close: the marks go with the tree."""
        self.entries.clear()
        self._by_head.clear()
        self._next_expiry = INF

    # ------------------------------------------------------------------ calls
    def pin(
        self, step: Step, tokens: Any, salt: bytes, tiers: tuple[str, ...], ttl: float | None
    ) -> PinOutcome:
        shared = self._shared
        bad = [t for t in tiers if t not in PIN_TIERS]
        if bad or not tiers:
            raise InvalidRequest(f"pin: tiers must be some of {PIN_TIERS}, got {tiers!r}")
        tokens, encoded = self._aligned(tokens, "pin")
        if not len(encoded):
            raise InvalidRequest(
                f"pin: {len(tokens)} tokens hold no whole page (page_size={shared.cfg.page_size})"
            )
        until = INF if ttl is None else step.now + ttl
        entry = PinEntry(
            tokens,
            device_until=until if "device" in tiers else -INF,
            host_until=until if "host" in tiers else -INF,
        )
        key = (salt, encoded.tobytes())
        self._purge(step)
        for tier in tiers:
            cap = shared.cfg.pin_cap(tier)
            total = self._pinned(step, tier, {**self.entries, key: entry})
            if total > cap:
                raise PinLimitError(
                    tier, total - self._pinned(step, tier, self.entries), total, cap
                )
        replaced = self.entries.get(key)
        self.entries[key] = entry
        self._next_expiry = min(self._next_expiry, max(entry.device_until, entry.host_until))
        self._by_head.setdefault(self._head(key), set()).add(key[1])
        if replaced is not None:  # a pin of the same prefix: its marks give way to this one
            self._tiers.unmark_pins(step, replaced.tokens, salt)
            self._mark_around(step, key)
        cached = self._mark(step, key, entry)
        step.out.info("tree.pin", tokens=len(encoded), cached=cached, tiers=list(tiers), ttl=ttl)
        return PinOutcome(
            tokens=len(encoded), cached_tokens=cached, until=None if ttl is None else until
        )

    def unpin(self, step: Step, tokens: Any, salt: bytes) -> bool:
        tokens, encoded = self._aligned(tokens, "unpin")
        key = (salt, encoded.tobytes())
        entry = self.entries.get(key)
        if entry is None:
            return False
        self._drop(key)
        self._tiers.unmark_pins(step, entry.tokens, salt)
        self._mark_around(step, key)
        step.out.info("tree.unpin", tokens=len(encoded))
        return True

    def after_insert(self, step: Step, tokens: Any, salt: bytes) -> None:
        """Pages of `tokens` were just cached: mark those under a pinned prefix."""
        if not self.entries:
            return
        shared = self._shared
        if step.now >= self._next_expiry:
            self._purge(step)
        page = shared.cfg.page_size
        if len(tokens) < page:
            return
        head = (salt, shared.tree.check_key(tokens[:page]).tobytes())
        self._mark_around(step, head, whole=False)

    # ------------------------------------------------------------------ helpers
    def _aligned(self, tokens: Any, action: str) -> tuple[Any, np.ndarray]:
        page = self._shared.cfg.page_size
        try:
            encoded = self._shared.tree.check_key(tokens)
        except TreeError as exc:
            raise InvalidRequest(f"{action}: {exc}") from None
        n = len(encoded) // page * page
        return tokens[:n], encoded[:n]

    def _head(self, key: Key) -> Key:
        return key[0], key[1][: self._shared.tree.page_bytes]

    def _mark(self, step: Step, key: Key, entry: PinEntry) -> int:
        return self._tiers.mark_pins(
            step,
            entry.tokens,
            device_until=entry.device_until,
            host_until=entry.host_until,
            salt=key[0],
        )

    def _mark_around(self, step: Step, key: Key, *, whole: bool = True) -> None:
        """Mark again every live pin sharing `key`'s first page (dropping expired ones)."""
        head = self._head(key) if whole else key
        prefixes = self._by_head.get(head)
        if not prefixes:
            return
        now = step.now
        for raw in list(prefixes):
            other = (head[0], raw)
            entry = self.entries[other]
            if entry.live(now):
                self._mark(step, other, entry)
            else:
                self._drop(other)

    def _drop(self, key: Key) -> None:
        del self.entries[key]
        head = self._head(key)
        prefixes = self._by_head[head]
        prefixes.discard(key[1])
        if not prefixes:
            del self._by_head[head]

    def _purge(self, step: Step) -> None:
        """Drop the pins that have ended (their marks ended with them)."""
        now = step.now
        for key in [k for k, e in self.entries.items() if not e.live(now)]:
            self._drop(key)
        ends = (max(e.device_until, e.host_until) for e in self.entries.values())
        self._next_expiry = min(ends, default=INF)

    def _pinned(self, step: Step, tier: str, entries: dict[Key, PinEntry]) -> int:
        """Tokens pinned in `tier`: the union of the live prefixes (sorted, each one's pages
        less those it shares with its neighbour)."""
        now = step.now
        page_bytes = self._shared.tree.page_bytes
        total = 0
        by_salt: dict[bytes, list[bytes]] = {}
        for (salt, raw), entry in entries.items():
            if entry.until(tier) > now:
                by_salt.setdefault(salt, []).append(raw)
        for raws in by_salt.values():
            raws.sort()
            total += sum(len(r) for r in raws)
            for a, b in itertools.pairwise(raws):
                total -= _shared_pages(a, b, page_bytes)
        return total // (page_bytes // self._shared.cfg.page_size)


def _shared_pages(a: bytes, b: bytes, page_bytes: int) -> int:
    """Bytes of the whole pages two encoded prefixes share."""
    n, end = 0, min(len(a), len(b))
    while n + page_bytes <= end and a[n : n + page_bytes] == b[n : n + page_bytes]:
        n += page_bytes
    return n
