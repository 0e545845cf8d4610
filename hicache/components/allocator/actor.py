"""The allocator actor: prepares the host pool and leases it to the tree, chunk by chunk.

Faulting in and pinning a large host pool takes seconds (docs/benchmarks.md, "Pinning"), so
the cache does not wait for all of it. Before the actor system starts, `open` prepares the first
chunk and puts its lease (`HostSlotsReady`) first in the tree's inbox, ahead of any request;
once running, a task of this actor prepares the other chunks in order, off the event loop, and
the actor leases each to the tree as it becomes ready: L2 grows while the cache serves. The
device tier is the tree's, whole, from the start. At close, once no copy can touch the pool,
`release` takes it back: every registration is undone.

Deterministic mode runs no thread: a chunk is prepared on the loop at the virtual instant its
preparation would end at `transfer_bandwidth` bytes/s, so when each lease arrives follows from
the configuration alone.

A chunk whose registration fails is not leased, and an event says which and why: a copy
engine may read the pool through its device mapping, where an unregistered page faults. The
other chunks go on. When the first chunk fails, the whole pool comes from torch's pinned
allocator instead (`HostPool.fall_back`) and is leased at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import anyio.to_thread

from hicache.components.allocator.chunks import chunk_plan
from hicache.kernels.pools import HostPool
from hicache.messages import AllocatorInbox, ChunkPrepared, HostSlotsReady, TreeInbox
from hicache.runtime import Actor, ActorSystemClosed, Mailbox


class AllocatorActor(Actor[AllocatorInbox]):
    def __init__(
        self,
        *,
        host: HostPool,
        tree: Mailbox[TreeInbox],
        chunk_bytes: int,
        modelled_rate: float | None,
        capacity: int,
    ) -> None:
        """`chunk_bytes`: about how much of the pool each lease covers (whole pages, at least
        one; 0: all of it at once). `modelled_rate`: bytes/s a chunk's preparation takes in
        virtual time (deterministic mode), None to prepare on a thread in real time."""
        super().__init__("allocator", capacity=capacity)
        if chunk_bytes < 0:
            raise ValueError(f"chunk_bytes must be >= 0, got {chunk_bytes}")
        self._host = host
        self._tree = tree
        self._rate = modelled_rate
        page_bytes = host.nbytes // host.pages
        whole = chunk_bytes == 0 or not host.lazy
        chunk_pages = host.pages if whole else max(1, chunk_bytes // page_bytes)
        # Chunks not prepared yet, in order: the preparing task's alone once running.
        self._plan = deque(chunk_plan(host.size, host.page_size, chunk_pages))
        self.chunks = len(self._plan)
        self.leased = 0  # host tokens leased to the tree so far
        self.withheld: dict[int, int] = {}  # start -> stop of chunks whose registration failed
        self._preparing = False  # the task preparing the chunks after the first runs

    async def open(self) -> None:
        """Before the actor system starts: prepare the first chunk (all of the pool when its
        registration fails: `HostPool.fall_back`) and lease it, first in the tree's inbox."""
        start, stop = self._plan.popleft()
        why = await self._prepare(start, stop)
        if why is not None:
            self._host.fall_back(why)
            stop = self._host.size
            self._plan.clear()
        self._tree.send_nowait(HostSlotsReady(start=start, stop=stop))
        self.leased = stop - start

    async def on_start(self) -> None:
        self.log.info(
            "allocator.host_leased",
            start=0,
            stop=self.leased,
            leased=self.leased,
            size=self._host.size,
            pinning=self._host.pinning,
        )
        if self._plan:
            self._preparing = True
            self.system.start_soon(self._prepare_rest, name="allocator.prepare")
        else:
            self._ready()

    async def _prepare(self, start: int, stop: int) -> str | None:
        if self._rate is not None:  # deterministic: on the loop, no thread
            return self._host.prepare_slots(start, stop)
        prepare: Callable[[int, int], str | None] = self._host.prepare_slots
        return await anyio.to_thread.run_sync(prepare, start, stop)

    async def _prepare_rest(self) -> None:
        """The chunks after the first, in order; each reported to this actor's inbox."""
        while self._plan:
            start, stop = self._plan[0]
            began = self.system.now()
            if self._rate is not None:  # the preparation's modelled duration, then its work
                nbytes = sum(hi - lo for lo, hi in self._host.slot_bytes(start, stop))
                await self.system.sleep(nbytes / self._rate)
            why = await self._prepare(start, stop)
            self._plan.popleft()
            seconds = self.system.now() - began
            report = ChunkPrepared(start=start, stop=stop, seconds=seconds, error=why)
            try:
                await self.inbox.send(report)
            except ActorSystemClosed:  # stopping while the chunk was prepared: `release` undoes it
                return

    async def handle(self, msg: AllocatorInbox) -> None:
        start, stop = msg.start, msg.stop
        if msg.error is None:
            try:
                await self._tree.send(HostSlotsReady(start=start, stop=stop))
            except ActorSystemClosed:  # stopping (the tree's inbox is closed): nothing to lease to
                return
            self.leased += stop - start
            self.log.info(
                "allocator.host_leased",
                start=start,
                stop=stop,
                leased=self.leased,
                size=self._host.size,
                seconds=round(msg.seconds, 6),
            )
        else:
            self.withheld[start] = stop
            self.log.warning(
                "allocator.pin_failed",
                start=start,
                stop=stop,
                tokens=stop - start,
                reason=msg.error,
            )
        if self.leased + self.withheld_tokens == self._host.size:
            self._preparing = False
            self._ready()

    def _ready(self) -> None:
        self.log.info(
            "allocator.host_ready",
            leased=self.leased,
            withheld=self.withheld_tokens,
            chunks=self.chunks,
            pinning=self._host.pinning,
        )

    @property
    def withheld_tokens(self) -> int:
        return sum(stop - start for start, stop in self.withheld.items())

    def tables(self) -> dict[str, int]:
        """What the allocator still holds: chunks not prepared, ranges still registered."""
        return {
            "chunks_pending": len(self._plan),
            "pinned_ranges": len(self._host.memory.registered),
        }

    def release(self) -> int:
        """At close, once the actor system and the copy streams have stopped: take the pool back,
        undoing every registration (the memory stays readable, unpinned). How many ranges
        were registered. Idempotent."""
        return self._host.unpin()
