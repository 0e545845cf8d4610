"""The scheduler half's L2 ledger (`HostIndex`) and what travels between the halves each step
(`HiCacheMetadata` with its `LoadPlan`s, `HiCacheWorkerMetadata` back)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from hicache.integrations.vllm.compat import MetadataBase, WorkerMetadataBase


class HostIndex:
    """The L2 ledger, in vLLM's scheduler: which page hash each host slot holds, least
    recently used first. Slots pinned for the step being built are never evicted in it."""

    def __init__(self, slots: int) -> None:
        if slots <= 0:
            raise ValueError(f"the host pool needs at least one slot, got {slots}")
        self.slots = slots
        self._by_hash: OrderedDict[str, int] = OrderedDict()
        self._hash_of: dict[int, str] = {}
        self._free = list(range(slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._held: dict[str, int] = {}  # page hash -> in-flight async loads that need it
        self.evictions = 0
        self.removed: list[str] = []  # pages evicted or forgotten since the last drain

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, page_hash: str) -> int | None:
        return self._by_hash.get(page_hash)

    def touch(self, page_hash: str) -> None:
        if page_hash in self._by_hash:
            self._by_hash.move_to_end(page_hash)

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def hold(self, page_hash: str) -> None:
        """Keep `page_hash` from eviction across steps, until as many `release`s: an
        asynchronous load still reads (or fills) its slot in a later step."""
        self._held[page_hash] = self._held.get(page_hash, 0) + 1

    def release(self, page_hash: str) -> None:
        n = self._held.get(page_hash, 0) - 1
        if n > 0:
            self._held[page_hash] = n
        else:
            self._held.pop(page_hash, None)

    @property
    def held(self) -> int:
        """Page hashes held (0 once every asynchronous load has finished)."""
        return len(self._held)

    def allocate(self, page_hash: str) -> int | None:
        """A slot for a page not in the index (recorded at once, pinned), evicting the least
        recently used unpinned page if none is free; None when every slot is pinned."""
        if page_hash in self._by_hash:
            raise ValueError(f"page {page_hash[:12]} is already in L2")
        if self._free:
            slot = self._free.pop()
        else:
            victim = next(
                (
                    h
                    for h, s in self._by_hash.items()
                    if s not in self._pinned and h not in self._held
                ),
                None,
            )
            if victim is None:
                return None
            slot = self._by_hash.pop(victim)
            del self._hash_of[slot]
            self.evictions += 1
            self.removed.append(victim)
        self._by_hash[page_hash] = slot
        self._hash_of[slot] = page_hash
        self._pinned.add(slot)
        return slot

    def forget(self, slot: int, page_hash: str) -> bool:
        """Drop `slot` if it still holds `page_hash` (a failed read the worker reported)."""
        if self._hash_of.get(slot) != page_hash:
            return False
        del self._hash_of[slot]
        del self._by_hash[page_hash]
        self._free.append(slot)
        self._pinned.discard(slot)
        self.removed.append(page_hash)
        return True

    def clear(self) -> None:
        self.removed.extend(self._by_hash)
        self._by_hash.clear()
        self._hash_of.clear()
        self._free = list(range(self.slots - 1, -1, -1))
        self._pinned.clear()


@dataclass(slots=True)
class LoadPlan:
    """One request's load: page i's vLLM blocks `block_ids[i]` (one per KV cache group) get
    host slot `slots[i]`, read first from L3 where `read[i]` (the page hash `hashes[i]`). `background`: vLLM was told the load is
    asynchronous (the request waits in WAITING_FOR_REMOTE_KVS until the worker reports it in
    `get_finished`); otherwise it lands before the forward of the step that sent it."""

    req_id: str
    block_ids: list[tuple[int, ...]]
    slots: list[int]
    hashes: list[str]
    read: list[bool]
    background: bool = False


class HiCacheMetadata(MetadataBase):
    """Scheduler -> workers, one per step: the host pool's shape and the step's transfers."""

    def __init__(self, host_slots: int, page_bytes: int) -> None:
        self.host_slots = host_slots
        self.page_bytes = page_bytes
        self.loads: list[LoadPlan] = []
        self.store_blocks: list[tuple[int, ...]] = []  # a page's blocks, one per group
        self.store_slots: list[int] = []
        self.store_hashes: list[str] = []
        self.prefetch_slots: list[int] = []  # L3 -> L2 reads for no request (best_effort)
        self.prefetch_hashes: list[str] = []
        self.saving: list[str] = []  # finished requests whose blocks wait for this step's stores


class HiCacheWorkerMetadata(WorkerMetadataBase):
    """Workers -> scheduler: host slots whose L3 read failed (slot, page hash), and the L3
    writes that landed or failed (for the "STORAGE" events)."""

    def __init__(self, bad: set[tuple[int, str]] | None = None) -> None:
        self.bad: set[tuple[int, str]] = set(bad or ())
        self.uploaded: dict[str, int] = {}  # page hash -> workers whose L3 write of it landed
        self.upload_failed: set[str] = set()
        self.prefetched: dict[str, int] = {}  # page hash -> workers whose prefetch ended

    def aggregate(self, other: Any) -> HiCacheWorkerMetadata:
        out = HiCacheWorkerMetadata(self.bad | set(getattr(other, "bad", ())))
        out.uploaded = dict(self.uploaded)
        for h, n in dict(getattr(other, "uploaded", None) or {}).items():
            out.uploaded[h] = out.uploaded.get(h, 0) + n
        out.upload_failed = self.upload_failed | set(getattr(other, "upload_failed", ()))
        out.prefetched = dict(self.prefetched)
        for h, n in dict(getattr(other, "prefetched", None) or {}).items():
            out.prefetched[h] = out.prefetched.get(h, 0) + n
        return out
