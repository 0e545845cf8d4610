"""The connector's scheduler half, in vLLM's scheduler process: the L2 index, the L3 probe,
each step's plan, the counters and KV events of its decisions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hicache.integrations.vllm.compat import log
from hicache.integrations.vllm.groups import Row, hole, hybrid_model, storable
from hicache.integrations.vllm.layout import Geometry, salt_prior
from hicache.integrations.vllm.metrics import Counters, EventLog
from hicache.integrations.vllm.options import ConnectorOptions
from hicache.integrations.vllm.plan import HiCacheMetadata, HostIndex, LoadPlan
from hicache.integrations.vllm.storage import Storage
from hicache.radix.hashes import chain_page_hashes
from hicache.types import PageHash

SCHEDULER_METRICS = (
    "lookups",
    "hit_l2_pages",
    "hit_l3_pages",
    "l2_evictions",
    "l2_forgotten",
    "no_slot",
    "async_loads",
    "prefetch_pages",
    "write_back_requests",
)


@dataclass(slots=True)
class _Request:
    request: Any  # vllm.v1.request.Request (live in the scheduler process)
    prior: PageHash | None
    hashes: list[str] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)  # one list per KV cache group
    probe_start: int = 0  # pages vLLM had locally at the last probe
    stored: int = 0  # pages (from the first) already stored or found in L2
    waited: bool = False  # had an asynchronous load: later lookups offer landed L2 pages only
    failed: bool = False  # its load failed (several groups): recomputed, never offered again


def _rows(block_ids: list[list[int]], first: int, end: int) -> list[Row]:
    """Pages [first, end)'s blocks, one per group (vLLM's per-group block tables)."""
    return [tuple(ids[i] for ids in block_ids) for i in range(first, end)]


class SchedulerSide:
    """The connector's scheduler half: the L2 index, the L3 probe, the step's plan."""

    def __init__(
        self,
        options: ConnectorOptions,
        geometry: Geometry,
        host_slots: int,
        storage: Storage | None = None,
        events: EventLog | None = None,
        tp_size: int = 1,
    ) -> None:
        self.options = options
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.model = hybrid_model(geometry)  # hicache's hit rule over vLLM's groups
        # Several groups: every load is asynchronous, since vLLM takes a failed load of a
        # hybrid model only per request (`failed_recving`), not per block.
        self.always_async = geometry.hybrid
        self.index = HostIndex(host_slots)
        self.storage = storage
        self.events = events or EventLog(False, geometry.block_size)
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadPlan] = []
        self.stats = Counters(SCHEDULER_METRICS)
        self._uploads = storage is not None and options.storage_write and storage.namespace.writes
        self.tp_size = tp_size
        self._filling: set[str] = set()  # pages an L3 read in flight will land in L2
        self._loading: dict[str, LoadPlan] = {}  # asynchronous loads not yet reported ended
        self._prefetching: dict[str, int] = {}  # prefetched page -> workers that ended it
        self._prefetch: list[tuple[int, str]] = []  # (slot, page) for the next step's metadata
        self._finishing: list[tuple[_Request, int, list[list[int]]]] = []  # write-back at free

    def _entered(self, st: _Request, page: int, page_hash: str, *, upload: bool) -> None:
        if self.events.enabled:
            self.drain_removed()  # an eviction this allocation made is announced first
            payload = EventLog.payload(st.request, page, st.hashes, self.block_size)
            self.events.entered_l2(page_hash, payload, upload=upload)

    def drain_removed(self) -> None:
        """Count and announce the pages the index dropped since the last call."""
        removed, self.index.removed = self.index.removed, []
        self.events.left_l2(removed)

    def _state(self, request: Any) -> _Request:
        rid = str(request.request_id)
        st = self._requests.get(rid)
        if st is None or st.request is not request:
            salt = getattr(request, "cache_salt", None) if self.options.salt_requests else None
            st = _Request(request=request, prior=salt_prior(salt))
            self._requests[rid] = st
        return st

    def _hashes(self, st: _Request, pages: int) -> list[str]:
        """The hashes of the request's first `pages` whole pages (cached, extended)."""
        have = len(st.hashes)
        if pages > have:
            tokens = list(
                st.request.all_token_ids[have * self.block_size : pages * self.block_size]
            )
            prior = PageHash(st.hashes[-1]) if st.hashes else st.prior
            st.hashes.extend(chain_page_hashes(tokens, self.block_size, prior=prior))
        return st.hashes[:pages]

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(Tokens past vLLM's own block-aligned hit that L2 or L3 holds, whole pages only,
        always leaving one token for vLLM to compute; whether the load is asynchronous).

        A page from L3, or one in L2 that a read in flight is still filling, makes the load
        asynchronous (`wait_complete`, `timeout`); under `best_effort` the hit stops before
        such pages and the ones in L3 are read into L2 in the background for the next
        request that needs them."""
        self.stats.add("lookups")
        st = self._state(request)
        if st.failed:
            return 0, False
        start = num_computed_tokens // self.block_size
        st.probe_start = start
        limit = self.model.cap(int(request.num_tokens), int(request.num_tokens)) // self.block_size
        if limit <= start:
            return 0, False
        hashes = self._hashes(st, limit)
        if self.options.prefetch_policy == "best_effort" or st.waited:
            # One asynchronous load per request: one that failed in part would otherwise be
            # planned again (L3 still lists the page) and the request never run.
            tokens = self._l2_hit(st, hashes, start, limit, prefetch=not st.waited)
            return tokens, self.always_async and tokens > 0
        end, background = start, self.always_async
        while end < limit and self.index.lookup(hashes[end]) is not None:
            background |= hashes[end] in self._filling
            end += 1
        if self.storage is not None and end < limit:
            in_l3 = self.storage.exists(hashes[end:limit])
            end += in_l3
            background |= in_l3 > 0
        hit = self.model.usable(int(request.num_tokens), end * self.block_size)
        return max(0, hit - start * self.block_size), background and hit > start * self.block_size

    def _l2_hit(
        self, st: _Request, hashes: list[str], start: int, limit: int, *, prefetch: bool
    ) -> int:
        """The tokens of the pages landed in L2; what L3 holds past the pages L2 has or is
        filling is read into L2 in the background, for the next request that needs it."""
        end = start
        while (
            end < limit
            and self.index.lookup(hashes[end]) is not None
            and hashes[end] not in self._filling
        ):
            end += 1
        probe = end
        while prefetch and probe < limit and self.index.lookup(hashes[probe]) is not None:
            probe += 1
        if prefetch and self.storage is not None and probe < limit:
            self._prefetch_pages(hashes[probe : probe + self.storage.exists(hashes[probe:limit])])
        hit = self.model.usable(int(st.request.num_tokens), end * self.block_size)
        return max(0, hit - start * self.block_size)

    def _prefetch_pages(self, hashes: list[str]) -> None:
        """Read these L3 pages into L2 for no request (best_effort), in the next step."""
        for h in hashes:
            slot = self.index.allocate(h)
            if slot is None:
                self.stats.add("no_slot")
                return
            self.index.hold(h)
            self._filling.add(h)
            self._prefetching[h] = 0
            self._prefetch.append((slot, h))
            self.stats.add("prefetch_pages")

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the pages vLLM accepted, into the blocks it allocated. A load with
        pages to read from L3 (or still being read) is asynchronous: its pages are held in L2
        until the workers report it ended."""
        if num_external_tokens <= 0:
            return
        st = self._state(request)
        start = st.probe_start
        pages = -(-num_external_tokens // self.block_size)
        rows = _rows([list(ids) for ids in blocks.get_block_ids()], start, start + pages)
        hashes = self._hashes(st, start + pages)
        plan = LoadPlan(str(request.request_id), [], [], [], [], background=self.always_async)
        gap = hole(self.geometry, rows, start, (start + pages) * self.block_size)
        if gap is not None:  # vLLM left no block where the hit needs K/V: recompute it all
            log.warning("hicache: no block for page %d of group %d: load refused", *gap)
        for i in range(start, start + pages):
            h = hashes[i]
            slot = self.index.lookup(h)
            read = slot is None
            if gap is not None:
                slot, read = -1, False  # the worker fails the load: vLLM recomputes
            elif slot is None:
                slot = self.index.allocate(h)
                if slot is None:  # every slot pinned or held: the worker reports an error
                    self.stats.add("no_slot")
                    slot = -1
                    read = False
                else:
                    self.stats.add("hit_l3_pages")
                    self._entered(st, i, h, upload=False)
            else:
                self.index.touch(h)
                self.index.pin(slot)
                self.stats.add("hit_l2_pages")
            plan.background |= read or h in self._filling
            plan.block_ids.append(rows[i - start])
            plan.slots.append(slot)
            plan.hashes.append(h)
            plan.read.append(read)
        if plan.background:
            st.waited = True
            self.stats.add("async_loads")
            for h, slot, read in zip(plan.hashes, plan.slots, plan.read):
                if slot >= 0:
                    self.index.hold(h)
                if read:
                    self._filling.add(h)
            self._loading[plan.req_id] = plan
        self._loads.append(plan)

    def loads_ended(self, req_ids: Any) -> None:
        """The workers report these requests' asynchronous loads ended (`finished_recving`):
        their pages may be evicted again, and pages read are now L2's like any other."""
        for rid in req_ids or ():
            plan = self._loading.pop(str(rid), None)
            if plan is None:
                continue
            for h, slot, read in zip(plan.hashes, plan.slots, plan.read):
                if slot >= 0:
                    self.index.release(h)
                if read:
                    self._filling.discard(h)

    def loads_failed(self, req_ids: Any) -> None:
        """The workers report these requests' loads failed (`failed_recving`, several
        groups): vLLM recomputes them, and no later lookup offers them anything, so a load
        that cannot land is never planned again."""
        for rid in req_ids or ():
            st = self._requests.get(str(rid))
            if st is not None:
                st.failed = True

    def build_meta(self, scheduler_output: Any) -> HiCacheMetadata:
        meta = HiCacheMetadata(self.index.slots, self.geometry.page_bytes)
        meta.loads, self._loads = self._loads, []
        for slot, h in self._prefetch:
            meta.prefetch_slots.append(slot)
            meta.prefetch_hashes.append(h)
        self._prefetch.clear()
        for done, computed, block_ids in self._finishing:
            done.block_ids = block_ids
            self._plan_stores(meta, done, computed)
            meta.saving.append(str(done.request.request_id))
        self._finishing.clear()
        write_through = self.options.write_policy == "write_through"
        sched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._requests.get(new.req_id)
            if st is None:
                continue
            st.block_ids = [list(ids) for ids in new.block_ids]
            st.stored = min(st.stored, int(new.num_computed_tokens) // self.block_size)
            if write_through:
                self._plan_stores(meta, st, int(new.num_computed_tokens) + int(sched[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._requests.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not st.block_ids:
                    st.block_ids = [[] for _ in new_ids]
                for ids, more in zip(st.block_ids, new_ids):
                    ids.extend(more)
            if write_through:
                self._plan_stores(meta, st, int(cached.num_computed_tokens[i]) + int(sched[rid]))
        self.index.unpin_all()
        self.drain_removed()
        return meta

    def _plan_stores(self, meta: HiCacheMetadata, st: _Request, computed: int) -> None:
        """Write-through: every page whose tokens are all computed by the end of this step
        and known now goes to L2 (and from there to L3) unless L2 has it."""
        known = len(st.request.all_token_ids)
        pages = min(computed, known) // self.block_size
        pages = min([pages, *(len(ids) for ids in st.block_ids)]) if st.block_ids else 0
        if pages <= st.stored:
            return
        hashes = self._hashes(st, pages)
        rows = _rows(st.block_ids, 0, pages)
        for i in range(st.stored, pages):
            h = hashes[i]
            if self.index.lookup(h) is not None:
                self.index.touch(h)
                continue
            if not storable(self.geometry, rows[i]):
                continue  # vLLM already dropped a group's block of it: not stored whole
            slot = self.index.allocate(h)
            if slot is None:
                self.stats.add("no_slot")
                break
            meta.store_blocks.append(rows[i])
            meta.store_slots.append(slot)
            meta.store_hashes.append(h)
            self._entered(st, i, h, upload=self._uploads)
        st.stored = pages

    def request_finished(self, request: Any, block_ids: Any) -> bool:
        """Forget the request. Under write_back its computed pages that L2 lacks are stored
        in the next step: True asks vLLM to keep its blocks (`block_ids`: one list per KV
        cache group) until the workers report the stores ran (`finished_sending`). A request
        whose load is still in flight (aborted while waiting for it) stores nothing: its
        blocks may not hold its KV yet."""
        rid = str(request.request_id)
        st = self._requests.pop(rid, None)
        if st is None or self.options.write_policy != "write_back" or rid in self._loading:
            return False
        blocks = [list(ids) for ids in block_ids or ()]
        computed = min(int(request.num_computed_tokens), len(st.request.all_token_ids))
        pages = min([computed // self.block_size, *(len(ids) for ids in blocks)])
        hashes = self._hashes(st, pages)
        if all(self.index.lookup(h) is not None for h in hashes[st.stored : pages]):
            return False
        self._finishing.append((st, computed, blocks))
        self.stats.add("write_back_requests")
        return True

    def worker_feedback(self, worker_meta: Any) -> None:
        for slot, page_hash in getattr(worker_meta, "bad", ()):
            if self.index.forget(slot, page_hash):
                self.stats.add("l2_forgotten")
        for h, n in dict(getattr(worker_meta, "prefetched", None) or {}).items():
            if h not in self._prefetching:
                continue
            self._prefetching[h] += n
            if self._prefetching[h] >= self.tp_size:  # every rank's read ended
                del self._prefetching[h]
                self.index.release(h)
                self._filling.discard(h)
        self.drain_removed()
        self.events.uploaded(dict(getattr(worker_meta, "uploaded", None) or {}))
        self.events.upload_failed(list(getattr(worker_meta, "upload_failed", ())))

    def take_stats(self) -> dict[str, int]:
        evicted = self.index.evictions - self.stats["l2_evictions"]
        if evicted:
            self.stats.add("l2_evictions", evicted)
        return self.stats.take()

    def reset(self) -> None:
        """Empty the L2 index. Loads in flight keep their holds until they end; the pages
        they read are not kept (their slots may be reused at once: a worker never lets a
        load write a slot that a later step took)."""
        self.index.clear()
        for _, h in self._prefetch:  # never sent: nothing will report them ended
            self.index.release(h)
            self._filling.discard(h)
            self._prefetching.pop(h, None)
        self._prefetch.clear()
        self.drain_removed()

    @property
    def in_flight(self) -> int:
        """Asynchronous loads, prefetches and write-backs not yet ended (0 when idle)."""
        return len(self._loading) + len(self._prefetching) + len(self._finishing)

    @property
    def idle(self) -> bool:
        """Nothing in flight and no table of in-flight work holding an entry."""
        return not (
            self._loading or self._prefetching or self._finishing or self._filling or self._prefetch
        ) and (self.index.held == 0)
