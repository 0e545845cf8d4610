"""The worker half's loads from L3: each one reads into a buffer of its own in the background,
then lands (host slots, then vLLM's blocks) on the worker's thread, whole or as a prefix.

A load is one of
- a request's asynchronous load (`LoadPlan.background`): vLLM keeps the request in
  WAITING_FOR_REMOTE_KVS until `poll` reports it finished; its blocks are touched by nothing
  else meanwhile, so they are written when the load lands, after some step's forward;
- a request's synchronous load that reads from L3 (landed at once, before the forward);
- a prefetch (best_effort): pages read into L2 for no request, for the next one that needs them.

Why a buffer of its own: a read given up on (timeout, abort) may still be written by a
backend's thread; only the buffer sees that, never a host slot a later step reuses. A host
slot is written by whoever `take`s it last: a load that lost its slot to a later store or
read still lands in vLLM's blocks (from its buffer) but leaves the slot alone. A load that
takes a page from a slot another load is still filling waits for that load to land first.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from hicache.integrations.vllm.groups import Row
    from hicache.integrations.vllm.layout import Geometry
    from hicache.integrations.vllm.metrics import Counters
    from hicache.integrations.vllm.storage import Storage


class Pool(Protocol):
    """What loads need of the worker half (worker.WorkerSide): its host pool and accounts."""

    geometry: Geometry
    storage: Storage | None
    host: torch.Tensor | None
    valid: list[bool]
    slot_hash: list[str | None]
    bad: set[tuple[int, str]]
    stats: Counters

    def settle_upload(self, slot: int) -> None: ...
    def holds(self, slot: int, page_hash: str) -> bool: ...
    def fail_blocks(self, rows: list[Row], req_id: str | None = None) -> None: ...
    def copy_in(self, pairs: list[tuple[Row, int]], source: torch.Tensor) -> None: ...


READ_CHUNK = 16
"""Pages per L3 read call: a load past its deadline keeps the chunks that landed (a prefix)."""


@dataclass(eq=False, slots=True)
class Inflight:
    """One load in flight. `rows[i]`: the buffer row of position i's page, for pages read
    from L3; the others come from host slots (possibly after `after` lands them)."""

    req_id: str | None  # None: a prefetch
    block_ids: list[Row]  # vLLM's blocks to fill, per page (empty for a prefetch)
    slots: list[int]
    hashes: list[str]
    rows: dict[int, int]
    deadline: float
    staging: torch.Tensor | None = None
    chunks: list[tuple[int, int, concurrent.futures.Future[int]]] = field(default_factory=list)
    after: list[Inflight] = field(default_factory=list)
    done: bool = False

    def ready(self) -> bool:
        return all(f.done() for _, _, f in self.chunks) and all(a.done for a in self.after)

    def landed_rows(self) -> tuple[set[int], int]:
        """(buffer rows that landed, pages given up on at the deadline)."""
        rows: set[int] = set()
        late = 0
        for first, n, fut in self.chunks:
            got = 0
            if not fut.done():
                fut.cancel()
                late += n
            elif not fut.cancelled() and fut.exception() is None:
                got = max(0, min(n, int(fut.result())))
            rows.update(range(first, first + got))
        return rows, late


class Loads:
    """The worker's loads in flight, in the order they started (they land in that order)."""

    def __init__(self, worker: Pool) -> None:
        self.w = worker
        self.inflight: list[Inflight] = []
        self.filling: dict[int, Inflight] = {}  # host slot -> the load that will write it
        self.prefetched: list[str] = []  # prefetches that ended, not yet reported

    def take(self, slot: int, by: Inflight | None = None) -> None:
        """`slot` is about to be written: by the load `by`, or by a store (None). An older
        load filling it no longer owns it."""
        w = self.w
        w.settle_upload(slot)
        self.filling.pop(slot, None)
        w.valid[slot] = False
        w.slot_hash[slot] = None
        if by is not None:
            self.filling[slot] = by

    def begin(
        self,
        req_id: str | None,
        block_ids: list[Row],
        slots: list[int],
        hashes: list[str],
        read: list[bool],
        deadline_s: float,
    ) -> Inflight:
        import torch

        w = self.w
        positions = [i for i, r in enumerate(read) if r and slots[i] >= 0]
        load = Inflight(
            req_id,
            block_ids,
            slots,
            hashes,
            {i: k for k, i in enumerate(positions)},
            time.monotonic() + deadline_s,
        )
        for i, s in enumerate(slots):
            filler = self.filling.get(s) if s >= 0 and i not in load.rows else None
            if filler is not None and filler not in load.after:
                load.after.append(filler)
        for i in positions:
            self.take(slots[i], load)
        if positions and w.storage is not None:
            load.staging = torch.empty((len(positions), w.geometry.page_bytes), dtype=torch.uint8)
            for first in range(0, len(positions), READ_CHUNK):
                rows = range(first, min(len(positions), first + READ_CHUNK))
                targets = [[load.staging[r].numpy().data.cast("B")] for r in rows]
                names = [hashes[positions[r]] for r in rows]
                load.chunks.append((first, len(rows), w.storage.read_async(names, targets)))
        self.inflight.append(load)
        return load

    def wait(self, load: Inflight) -> None:
        """Land `load` now (a synchronous load), waiting for its reads up to its deadline."""
        futures = [f for _, _, f in load.chunks]
        concurrent.futures.wait(futures, timeout=max(0.0, load.deadline - time.monotonic()))
        self.land(load)
        self.inflight.remove(load)

    def poll(self, aborted: set[str]) -> set[str]:
        """Land every load that is ready or past its deadline, drop those of aborted
        requests; the request ids whose loads ended (landed, partly, or dropped)."""
        ended: set[str] = set()
        now = time.monotonic()
        for load in self.inflight:
            if load.req_id is not None and load.req_id in aborted:
                self.drop(load)
            elif load.ready() or now >= load.deadline:
                self.land(load)
            else:
                continue
            if load.req_id is not None:
                ended.add(load.req_id)
        self.inflight = [load for load in self.inflight if not load.done]
        return ended

    def drop(self, load: Inflight) -> None:
        """An aborted request's load: nothing lands; its slots are reported bad (forgotten)."""
        for _, _, fut in load.chunks:
            fut.cancel()
        for i in load.rows:
            s = load.slots[i]
            if self.filling.get(s) is load:
                del self.filling[s]
                self.w.bad.add((s, load.hashes[i]))
        self.w.stats.add("aborted_loads")
        self._end(load)

    def land(self, load: Inflight) -> None:
        """The pages read land in their host slots (where the load still owns them), then the
        longest prefix of pages available lands in vLLM's blocks; the rest are load errors."""
        w = self.w
        page_bytes = w.geometry.page_bytes
        landed, late = load.landed_rows()
        w.stats.add("load_timeouts", late)
        host = w.host
        assert host is not None
        for i, row in load.rows.items():
            s, h = load.slots[i], load.hashes[i]
            owned = self.filling.get(s) is load
            if owned:
                del self.filling[s]
            if row in landed:
                w.stats.add("l3_read_pages")
                w.stats.add("l3_read_bytes", page_bytes)
                if owned:
                    assert load.staging is not None
                    host[s] = load.staging[row]
                    w.valid[s] = True
                    w.slot_hash[s] = h
            else:
                w.stats.add("l3_read_failures")
                if owned:
                    w.bad.add((s, h))
        if load.block_ids:
            from_host: list[tuple[Row, int]] = []
            from_buffer: list[tuple[Row, int]] = []
            for i, b in enumerate(load.block_ids):
                got = load.rows.get(i)
                if got is not None and got in landed:
                    from_buffer.append((b, got))
                elif got is None and w.holds(load.slots[i], load.hashes[i]):
                    from_host.append((b, load.slots[i]))
                else:  # a prefix stays a prefix: vLLM recomputes from the first failed block
                    w.fail_blocks(load.block_ids[i:], load.req_id)
                    break
            if from_host:
                w.copy_in(from_host, host)
            if from_buffer:
                assert load.staging is not None
                w.copy_in(from_buffer, load.staging)
        self._end(load)

    def _end(self, load: Inflight) -> None:
        load.done = True
        load.staging = None
        if load.req_id is None:
            self.prefetched.extend(load.hashes)

    def take_prefetched(self) -> dict[str, int]:
        done, self.prefetched = self.prefetched, []
        return dict.fromkeys(done, 1)

    def close(self) -> None:
        for load in self.inflight:
            for _, _, fut in load.chunks:
                fut.cancel()
        self.inflight.clear()
        self.filling.clear()
