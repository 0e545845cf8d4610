"""The cache's tier policy without bytes, actors or time: what `hicache sweep` replays.

`CoreModel` drives the same synchronous cores the cache's actors drive (the `RadixTree` and
two `SlotLedger`s) through the same decisions the tree actor takes
(`hicache/components/tree/`: match, load-back threshold and credits, L1 eviction with
write-back and exclusive mode, write-through backups and their credits, L2 eviction, uploads
to L3, probe-then-read prefetches with their threshold and rate limit, insert, release), in one
thread. No KV bytes exist: slots are only counted. L3 is a set of page identities (storage on
means an unbounded store that never loses a page).

Time is the order of calls: every completion a worker would report (a backup, a load, an
upload, a prefetch's probe and read) is applied before the next frontend call, exactly as
the actor applies it when the worker answers in time; inside one call, only the completions
the actor itself waits for (`_await_write`, `_await_upload`) land. A real replay whose
transfers or storage calls are still in flight when the next call arrives can therefore take
other decisions; docs/benchmarks.md ("Sizing sweep") says where the two agree exactly.

`replay_trace` runs a trace through it in the scheduler steps `hicache replay` uses
(`hicache/cli/replay.py`), with the same fallback on `CapacityError`, and tallies what the
replay's summary reports.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.cli.trace import TraceRequest, scheduler_steps
from hicache.components.allocator.core import SlotLedger
from hicache.components.topology import Topology
from hicache.components.tree.core import RadixTree
from hicache.config import CacheConfig
from hicache.policies.eviction import make_strategy
from hicache.policies.write import write_policy
from hicache.results import CapacityError

_EMPTY = np.empty(0, dtype=np.int64)
_EMPTY.flags.writeable = False


class PageIds:
    """Page identities standing in for the chained page hashes of the L3 keys: equal ids
    exactly when the token prefixes up to the page's end are equal. Shared by every model of
    one sweep (the ids depend on tokens only).

    Tokens come from a trace (`TraceRequest.tokens`: block h is the ids h*B .. h*B+B-1), so
    given the prefix before it, a page's tokens are fixed by the tokens where a block starts
    inside it, and by its first token: those few ints are the key, not the page's bytes."""

    def __init__(self, page_size: int, block_tokens: int) -> None:
        self.page = page_size
        self.block = block_tokens
        self._ids: dict[tuple[Any, ...], int] = {}  # (previous page id, key tokens) -> id
        self._index: dict[int, int] = {0: -1}  # id -> its page's index in the sequence
        self._requests: dict[int, list[int]] = {}
        # where, inside a page that starts at a multiple of P, blocks may start
        self._aligned = block_tokens % page_size == 0

    def of_request(self, index: int, tokens) -> list[int]:
        """The ids of every whole page of a trace request's tokens (cached by its index)."""
        ids = self._requests.get(index)
        if ids is None:
            ids = self._requests[index] = self.chain(tokens, 0)
        return ids

    def chain(self, tokens, prior: int) -> list[int]:
        """Ids of the whole pages of `tokens`, which follow page `prior` (0: the start)."""
        page = self.page
        pages = len(tokens) // page
        if not pages:
            return []
        firsts = np.asarray(tokens[: pages * page : page]).tolist()
        ids, table, index = [], self._ids, self._index
        prev = prior
        if self._aligned:
            for first in firsts:
                key = (prev, first)
                nxt = table.get(key)
                if nxt is None:
                    nxt = table[key] = len(table) + 1
                    index[nxt] = index[prev] + 1
                ids.append(nxt)
                prev = nxt
            return ids
        arr = np.asarray(tokens)
        block = self.block
        start = (index[prior] + 1) * page  # where `tokens` starts in its sequence
        for k in range(pages):
            s = start + k * page
            inner = tuple(
                arr[j - start] for j in range(-(-(s + 1) // block) * block, s + page, block)
            )
            key = (prev, int(arr[k * page]), inner)
            nxt = table.get(key)
            if nxt is None:
                nxt = table[key] = len(table) + 1
                index[nxt] = index[prev] + 1
            ids.append(nxt)
            prev = nxt
        return ids


@dataclass(slots=True)
class _Request:  # the tree actor's RequestState, less what needs bytes
    lock: int | None = None
    last_node: int | None = None
    prefix_slots: np.ndarray = field(default_factory=lambda: _EMPTY)
    host_len: int = 0
    owned: list = field(default_factory=list)
    padding: np.ndarray = field(default_factory=lambda: _EMPTY)
    tokens: np.ndarray | None = None


@dataclass(slots=True)
class _Prefetch:  # the tree's PrefetchOp and the prefetcher's view of the same op
    rid: object
    anchor: int
    tokens: np.ndarray
    hashes: tuple
    host_slots: np.ndarray = field(default_factory=lambda: _EMPTY)
    hit_pages: int = -1  # the tree's agreed value
    done_pages: int = 0
    stopping: bool = False
    reading: bool = False
    state: str = "running"
    # the prefetcher's side: what its next report says
    probed: bool = False
    read_sent: bool = False
    stop_sent: bool = False
    finished: bool = False


@dataclass(slots=True)
class Tally:
    """What `hicache replay` reports, in tokens (its summary's fields)."""

    requests: int = 0
    input_tokens: int = 0
    device_hit: int = 0  # L1 tokens of the matches of the steps that completed
    host_hit: int = 0  # tokens loaded back from L2 (prefetched ones included)
    storage_hit: int = 0  # tokens read from L3 into L2
    rejected: int = 0
    device_evictions: int = 0
    host_evictions: int = 0
    d2h_tokens: int = 0
    h2d_tokens: int = 0

    def summary(self) -> dict:
        tokens = self.input_tokens or 1
        hits = {
            "device": self.device_hit,
            "host": self.host_hit - self.storage_hit,
            "storage": self.storage_hit,
        }
        return {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "hit_tokens": hits,
            "hit_rate": (self.device_hit + self.host_hit) / tokens,
            "evictions": {"device": self.device_evictions, "host": self.host_evictions},
            "rejected_requests": self.rejected,
            "transfer_tokens": {"d2h": self.d2h_tokens, "h2d": self.h2d_tokens},
        }


class CoreModel:
    """One cache's tiers, driven synchronously. `config` as for `HiCache` (resolved here);
    `storage`: an unbounded L3 or none. Supports the `wait_complete` prefetch policy (the
    replay's): the others stop prefetches at times only a clock decides."""

    def __init__(
        self,
        config: CacheConfig,
        *,
        storage: bool,
        block_tokens: int = 512,
        pages: PageIds | None = None,
    ) -> None:
        cfg, _ = config.resolve()
        if storage and cfg.prefetch_policy != "wait_complete":
            raise ValueError(
                "the core model replays prefetch_policy='wait_complete' only "
                f"(got {cfg.prefetch_policy!r}): the others depend on timing"
            )
        self.cfg = cfg
        self.page = cfg.page_size
        self.tree = RadixTree(
            page_size=cfg.page_size,
            eviction=make_strategy(cfg.eviction),
            write_policy=write_policy(cfg.write_policy),
        )
        self.ledgers = {
            "device": SlotLedger(size=cfg.device_tokens, page_size=cfg.page_size, tier="device"),
            "host": SlotLedger(size=cfg.host_capacity, page_size=cfg.page_size, tier="host"),
        }
        credits = Topology.for_capacity(cfg.channel_capacity).credits
        self.storage: set[int] | None = set() if storage else None
        self._requests: dict[object, _Request] = {}
        self._writes: dict[int, int] = {}  # op -> node, issue order
        self._evicting: dict[int, int] = {}  # op -> tokens, for the eviction backups in flight
        self._loads: dict[int, tuple] = {}  # op -> (plan, lock node)
        self._uploads: dict[int, tuple] = {}  # op -> (node, page ids)
        self._prefetches: dict[int, _Prefetch] = {}
        self._prefetch_by_rid: dict[object, int] = {}
        self._write_backlog: deque = deque()
        self._upload_backlog: deque = deque()
        self._arrived_writes: set[int] = set()
        self._arrived_uploads: set[int] = set()
        self._write_credits = self._load_credits = credits
        self._upload_credits = self._prefetch_credits = credits
        self._prefetch_tokens = 0
        self._next_op = 0
        self._clock = 0
        self.pages = pages if pages is not None else PageIds(cfg.page_size, block_tokens)
        self.host_hit = self.storage_hit = 0
        self.device_evictions = self.host_evictions = 0
        self.d2h_tokens = self.h2d_tokens = 0

    # ------------------------------------------------------------------ plumbing
    def _now(self) -> float:
        self._clock += 1
        return float(self._clock)

    def _op(self) -> int:
        self._next_op += 1
        return self._next_op

    def _alloc(self, tier: str, n: int):
        return self.ledgers[tier].alloc(n)

    def _free(self, tier: str, slots) -> None:
        if len(slots):
            self.ledgers[tier].free(slots)

    def _node_hashes(self, node: int) -> list[int]:
        hashes = self.tree.page_hashes(node)
        if hashes is None:
            parent = self.tree.parent(node)
            prior = 0 if parent == self.tree.root else self._node_hashes(parent)[-1]
            hashes = self.pages.chain(self.tree.key(node), prior)
            self.tree.set_page_hashes(node, hashes)
        return list(hashes)

    # ------------------------------------------------------------------ completions
    def frontend_call(self) -> None:
        """A frontend call arrives: every completion a worker owes has been applied first."""
        while True:
            progressed = False
            if self._writes:
                self._arrived_writes.update(self._writes)
                progressed = True
            if self._uploads:
                self._arrived_uploads.update(self._uploads)
                progressed = True
            if self._loads:
                progressed = True
            if self._prefetches:
                progressed = True
            if not progressed:
                return
            self._sync_point(all_loads=True, prefetch_step=True)

    def _sync_point(self, *, all_loads: bool = False, prefetch_step: bool = False) -> None:
        """Apply what has arrived, in the actor's order: writes (in issue order, up to the
        first still in flight), loads, uploads, then each prefetch's next step."""
        for op in list(self._writes):
            if op not in self._arrived_writes:
                break
            if op in self._writes:
                self._arrived_writes.discard(op)
                self._finish_write(op)
        if all_loads:
            for op in list(self._loads):
                if op in self._loads:
                    self._finish_load(op)
        for op in list(self._uploads):
            if op in self._arrived_uploads and op in self._uploads:
                self._arrived_uploads.discard(op)
                self._finish_upload(op)
        if prefetch_step:
            for op in list(self._prefetches):
                if op in self._prefetches:
                    self._prefetch_report(op)

    # ------------------------------------------------------------------ match
    def match(self, rid, tokens: np.ndarray) -> tuple[int, int]:
        tree = self.tree
        result = tree.match(tokens, now=self._now())
        state = self._requests.get(rid)
        if state is None:
            state = self._requests[rid] = _Request()
        self._relock(state, result.last_node)
        state.last_node = result.last_node
        state.prefix_slots = result.device_slots
        state.host_len = result.host_len
        state.tokens = tokens
        return len(result.device_slots), result.host_len

    def _rematch(self, state: _Request) -> None:
        result = self.tree.match(state.tokens, now=self._now())
        self._relock(state, result.last_node)
        state.last_node = result.last_node
        state.prefix_slots = result.device_slots
        state.host_len = result.host_len

    def _relock(self, state: _Request, node) -> None:
        if node is not None:
            self.tree.lock(node)
        if state.lock is not None:
            self.tree.unlock(state.lock)
        state.lock = node

    # ------------------------------------------------------------------ load back
    def load_back(self, rid) -> int:
        """Tokens now on the device for the request (its prefix, with what was loaded)."""
        state = self._requests[rid]
        if state.host_len < max(1, self.cfg.load_back_threshold) or state.last_node is None:
            return len(state.prefix_slots)
        if self._load_credits == 0:
            return len(state.prefix_slots)
        plan = self.tree.plan_load_back(state.last_node)
        if not plan.nodes:
            state.host_len = 0
            return len(state.prefix_slots)
        device_slots = self._alloc_device(plan.num_tokens)
        if device_slots is None:
            return len(state.prefix_slots)
        self.tree.commit_load_back(plan, device_slots)
        self.tree.lock(plan.nodes[-1])
        op = self._op()
        self._load_credits -= 1
        self._loads[op] = (plan, plan.nodes[-1])
        state.prefix_slots = np.concatenate([state.prefix_slots, device_slots])
        state.host_len = 0
        self.host_hit += plan.num_tokens
        self.h2d_tokens += plan.num_tokens
        return len(state.prefix_slots)

    def _finish_load(self, op: int) -> None:
        plan, lock = self._loads.pop(op)
        self._load_credits += 1
        self.tree.unlock(lock)
        if self.cfg.exclusive:
            self._free("host", self.tree.drop_host(plan))

    # ------------------------------------------------------------------ allocation
    def allocate(self, sizes: list[tuple[object, int]]) -> list[np.ndarray]:
        out, undo = [], []
        page = self.page
        wanted = [
            -(-max(0, n - len(self._requests[rid].padding)) // page) * page for rid, n in sizes
        ]
        pooled = self._alloc_device(sum(wanted)) if sum(wanted) else None
        offset = 0
        for (rid, n), want in zip(sizes, wanted):
            state = self._requests[rid]
            before = state.padding
            reuse = before[:n]
            rest = n - len(reuse)
            fresh = _EMPTY
            if rest and pooled is not None:
                fresh, offset = pooled[offset : offset + want], offset + want
            elif rest:
                fresh = self._alloc_device(want)
                if fresh is None:
                    for st, padding, new in reversed(undo):
                        st.owned.pop()
                        st.padding = padding
                        self._free("device", new)
                    raise CapacityError("device", n, self.ledgers["device"].available, rid=rid)
            state.padding = np.concatenate([before[n:], fresh[rest:]]) if rest else before[n:]
            slots = np.concatenate([reuse, fresh[:rest]])
            state.owned.append(slots)
            undo.append((state, before, fresh))
            out.append(slots)
        return out

    def _alloc_device(self, n: int):
        if n == 0:
            return _EMPTY
        while True:
            slots = self._alloc("device", n)
            if slots is not None:
                return slots
            short = (
                n
                - self.ledgers["device"].available
                - sum(self._evicting.get(op, 0) for op in self._writes)
            )
            if short > 0 and self._evict_device(short):
                continue
            if not self._writes:
                return None
            self._await_write(next(iter(self._writes)))

    def _evict_device(self, n: int) -> bool:
        tree = self.tree
        ev = tree.evict_device(n, now=self._now(), require_host_copy=self.cfg.exclusive)
        self._free("device", ev.freed)
        self._free("host", ev.freed_host)
        self.device_evictions += len(ev.freed)
        freed = len(ev.freed)
        for node in ev.needs_backup:
            if self.cfg.exclusive and not tree.outranks_host(node):
                gone = tree.discard_device(node)
                self._free("device", gone.freed)
                self._free("host", gone.freed_host)
                self.device_evictions += len(gone.freed)
                freed += len(gone.freed)
                continue
            self._start_backup(node, evicting=True)
        return freed > 0

    def _alloc_host(self, n: int):
        while True:
            slots = self._alloc("host", n)
            if slots is not None:
                return slots
            ev = self.tree.evict_host(
                n - self.ledgers["host"].available, by_pages=self.cfg.exclusive
            )
            if len(ev.freed):
                self.host_evictions += len(ev.freed)
                self._free("host", ev.freed)
                continue
            waiting = next(iter(self._uploads), None)
            if waiting is None:
                return None
            self._await_upload(waiting)

    # ------------------------------------------------------------------ insert
    def cache(self, items: list[tuple[object, np.ndarray, np.ndarray]]) -> None:
        """`cache_finished` for every item: (rid, tokens, device slots)."""
        candidates: list[int] = []
        try:
            for rid, tokens, slots in items:
                self._cache(rid, tokens, slots, candidates)
        finally:
            self._start_backups(candidates)

    def _cache(self, rid, tokens, slots, candidates) -> None:
        state = self._requests[rid]
        page = self.page
        aligned = len(tokens) // page * page
        own = len(state.prefix_slots)
        result = self.tree.insert(tokens[:aligned], slots[:aligned], now=self._now())
        self._free("device", slots[own : max(own, result.prefix_len)])
        candidates.extend(result.backup_candidates)
        self._free("device", np.concatenate([slots[aligned:], state.padding]))
        self._relock(state, None)
        del self._requests[rid]

    def release(self, rids) -> None:
        for rid in rids:
            state = self._requests.pop(rid)
            self._relock(state, None)
            self._free("device", np.concatenate([*state.owned, state.padding]))

    # ------------------------------------------------------------------ L1 -> L2 -> L3
    def _start_backup(self, node: int, *, evicting: bool) -> bool:
        tree = self.tree
        while self._write_credits == 0:
            if not evicting:
                self._write_backlog.append(node)
                return False
            self._await_write(next(iter(self._writes)))
        if not tree.needs_backup(node):
            return False
        length = tree.num_tokens(node)
        host = self._alloc_host(length)
        if host is None or not tree.needs_backup(node):
            self._free("host", _EMPTY if host is None else host)
            return False
        self._issue_backup(node, host, evicting=evicting)
        return True

    def _start_backups(self, nodes) -> None:
        tree = self.tree
        todo = [n for n in dict.fromkeys(nodes) if tree.needs_backup(n)]
        lengths = [tree.num_tokens(n) for n in todo]
        pooled = None
        if 1 < len(todo) <= self._write_credits:
            pooled = self._alloc("host", sum(lengths))
        if pooled is None:
            for node in todo:
                self._start_backup(node, evicting=False)
            return
        offset = 0
        for node, length in zip(todo, lengths):
            self._issue_backup(node, pooled[offset : offset + length])
            offset += length

    def _issue_backup(self, node: int, host, *, evicting: bool = False) -> None:
        self.tree.begin_backup(node, host)
        op = self._op()
        self._write_credits -= 1
        self._writes[op] = node
        if evicting:
            self._evicting[op] = len(host)
        self.d2h_tokens += len(host)

    def _await_write(self, op: int) -> None:
        while op in self._writes:
            self._arrived_writes.add(next(iter(self._writes)))
            self._sync_point()

    def _finish_write(self, op: int) -> None:
        node = self._writes.pop(op)
        self._evicting.pop(op, None)
        self._write_credits += 1
        pieces = self.tree.backup_pieces(node)
        self._free("host", self.tree.end_backup(node, ok=True))
        if self.storage is not None:
            self._upload(pieces)
        while self._write_backlog and self._write_credits:
            self._start_backup(self._write_backlog.popleft(), evicting=False)

    def _upload(self, pieces) -> None:
        tree = self.tree
        node = pieces[-1]
        if not tree.has_host_copy(node):
            return
        if self._upload_credits == 0:
            if len(self._upload_backlog) < self.cfg.max_upload_backlog:
                self._upload_backlog.append(pieces)
            return
        hashes = [h for p in pieces for h in self._node_hashes(p)]
        op = self._op()
        self._upload_credits -= 1
        tree.protect_host(node)
        self._uploads[op] = (node, hashes)

    def _await_upload(self, op: int) -> None:
        while op in self._uploads:
            self._arrived_uploads.add(op)
            self._sync_point()

    def _finish_upload(self, op: int) -> None:
        node, hashes = self._uploads.pop(op)
        self.storage.update(hashes)  # the store took every page (it never loses one)
        self._upload_credits += 1
        self.tree.release_host(node)
        while self._upload_backlog and self._upload_credits:
            pieces = self._upload_backlog.popleft()
            if all(self.tree.state(p).name in ("BOTH", "HOST_ONLY") for p in pieces):
                self._upload(pieces)

    # ------------------------------------------------------------------ L3 -> L2
    def prefetch(self, rid, tokens: np.ndarray, page_ids: list[int] | None = None) -> None:
        """`page_ids`: the ids of every whole page of `tokens`, when known (else chained
        from the anchor's, as the tree chains the hashes)."""
        state = self._requests[rid]
        if self.storage is None or rid in self._prefetch_by_rid:
            return
        tree, page = self.tree, self.page
        matched = len(state.prefix_slots) + state.host_len
        end = len(tokens) // page * page
        length = end - matched
        anchor = state.last_node
        if anchor is None or not tree.has_host_copy(anchor):
            return
        if length < self.cfg.effective_prefetch_threshold:
            return
        spare = self.cfg.host_capacity - self.cfg.device_tokens
        if (
            self._prefetch_tokens + length > int(self.cfg.prefetch_rate_fraction * spare)
            or self._prefetch_credits == 0
        ):
            return
        if page_ids is not None:
            hashes = tuple(page_ids[matched // page : end // page])
        else:
            prior = 0 if anchor == tree.root else self._node_hashes(anchor)[-1]
            hashes = tuple(self.pages.chain(tokens[matched:end], prior))
        op = self._op()
        tree.protect_host(anchor)
        self._prefetches[op] = _Prefetch(
            rid=rid, anchor=anchor, tokens=tokens[matched:end], hashes=hashes
        )
        self._prefetch_by_rid[rid] = op
        self._prefetch_credits -= 1
        self._prefetch_tokens += length

    def _prefetch_report(self, op: int) -> None:
        """The prefetcher's next report for the op, applied as the tree applies it."""
        p = self._prefetches[op]
        if p.stop_sent and not p.finished:  # a stop while idle after the probe ends it
            p.finished = True
            self._prefetch_agreed(op, finished=True, stopped=True)
            return
        if not p.probed:
            p.probed = True
            hit = 0
            stored = self.storage
            for h in p.hashes:
                if h not in stored:
                    break
                hit += 1
            p.finished = hit == 0
            self._prefetch_agreed(op, hit=hit, finished=p.finished, stopped=False)
            return
        if p.read_sent and not p.finished:
            p.finished = True
            self._prefetch_agreed(
                op, hit=p.hit_pages, done=p.hit_pages, finished=True, stopped=False
            )

    def _prefetch_agreed(
        self,
        op: int,
        *,
        hit: int | None = None,
        done: int | None = None,
        finished: bool,
        stopped: bool,
    ) -> None:
        p = self._prefetches[op]
        if p.state == "running":
            if hit is not None:
                p.hit_pages = hit
            if done is not None:
                p.done_pages = done
            threshold = self.cfg.effective_prefetch_threshold
            if p.hit_pages >= 0 and p.hit_pages * self.page < threshold:
                self._stop_prefetch(p)
                self._settle_prefetch(op, revoked=True)
            elif finished or stopped:
                p.stopping = True
                self._settle_prefetch(op, revoked=False)
            elif p.hit_pages >= 0 and not p.reading and not p.stopping:
                p.reading = True
                self._read_prefetch(op)
        if finished:
            self._end_prefetch(op)

    def _stop_prefetch(self, p: _Prefetch) -> None:
        if not p.stopping:
            p.stopping = True
            if not p.finished:
                p.stop_sent = True

    def _read_prefetch(self, op: int) -> None:
        p = self._prefetches[op]
        host = self._alloc_host(p.hit_pages * self.page)
        if host is None or p.state != "running" or p.stopping:
            self._free("host", _EMPTY if host is None else host)
            if p.state == "running":
                self._stop_prefetch(p)
                self._settle_prefetch(op, revoked=True)
            return
        p.host_slots = host
        p.read_sent = True

    def _settle_prefetch(self, op: int, *, revoked: bool) -> None:
        p = self._prefetches[op]
        page = self.page
        done = 0 if revoked else min(p.done_pages, len(p.host_slots) // page)
        p.done_pages = done
        used = done * page
        if done:
            inserted = self.tree.insert_host(
                p.anchor, p.tokens[:used], p.host_slots[:used], p.hashes[:done], now=self._now()
            )
            self._free("host", inserted.duplicate_slots)
        self.tree.release_host(p.anchor)
        p.state = "revoked" if revoked else "done"
        state = self._requests.get(p.rid)
        if state is not None and done:
            self.storage_hit += used
            self._rematch(state)
        del self._prefetch_by_rid[p.rid]

    def _end_prefetch(self, op: int) -> None:
        p = self._prefetches.pop(op)
        self._free("host", p.host_slots[p.done_pages * self.page :])
        self._prefetch_tokens -= len(p.hashes) * self.page
        self._prefetch_credits += 1

    # ------------------------------------------------------------------ close
    def drain(self) -> dict:
        """Close: finish everything, free every slot the tree holds; the ledgers' use after."""
        self.frontend_call()
        self.release(tuple(self._requests))
        cleared = self.tree.clear()
        self._free("device", cleared.device)
        self._free("host", cleared.host)
        return {tier: led.used for tier, led in self.ledgers.items()}


def _run_step(model: CoreModel, step: list[TraceRequest], tally: Tally, tokens_of) -> None:
    """One scheduler step, as `hicache.cli.replay._run_step` makes its calls."""
    toks = {f"r{r.index}": tokens_of(r) for r in step}
    index = {f"r{r.index}": r.index for r in step}
    model.frontend_call()
    device_hit = 0
    for rid, t in toks.items():
        device_hit += model.match(rid, t)[0]
    if model.storage is not None:
        model.frontend_call()
        for rid, t in toks.items():
            model.prefetch(rid, t, model.pages.of_request(index[rid], t))
        for _ in toks:  # one prefetch_wait per request: each is a frontend call
            model.frontend_call()
    model.frontend_call()
    prefix = {rid: model.load_back(rid) for rid in toks}
    model.frontend_call()
    # the caller's device slots: the prefix (the model does not track which), then new ones
    news = model.allocate([(rid, len(t) - prefix[rid]) for rid, t in toks.items()])
    model.frontend_call()
    items = []
    for (rid, t), new in zip(toks.items(), news):
        state = model._requests[rid]
        items.append((rid, t, np.concatenate([state.prefix_slots, new])))
    model.cache(items)
    tally.device_hit += device_hit
    tally.requests += len(step)
    tally.input_tokens += sum(len(t) for t in toks.values())


def replay_trace(
    config: CacheConfig,
    requests: list[TraceRequest],
    *,
    storage: bool,
    block_tokens: int = 512,
    batch: int = 8,
    progress=None,
    tokens_of=None,
    pages: PageIds | None = None,
) -> Tally:
    """The whole trace through a `CoreModel`, in the replay's scheduler steps. `tokens_of`
    (request -> uint32 tokens) and `pages` may be shared by the runs of one sweep."""
    model = CoreModel(config, storage=storage, block_tokens=block_tokens, pages=pages)
    tally = Tally()
    if tokens_of is None:

        def tokens_of(r):
            return r.tokens(block_tokens).astype(np.uint32)

    for step in scheduler_steps(requests, batch, budget=model.cfg.device_tokens // 2):
        try:
            _run_step(model, step, tally, tokens_of)
        except CapacityError:
            model.frontend_call()
            model.release([f"r{r.index}" for r in step])
            for req in step:
                try:
                    _run_step(model, [req], tally, tokens_of)
                except CapacityError:
                    model.frontend_call()
                    model.release([f"r{req.index}"])
                    tally.rejected += 1
                    tally.requests += 1
                    tally.input_tokens += req.input_length
        if progress is not None:
            progress(tally.requests)
    model.frontend_call()  # the replay's flush and stats
    tally.host_hit = model.host_hit
    tally.storage_hit = model.storage_hit
    tally.device_evictions = model.device_evictions
    tally.host_evictions = model.host_evictions
    tally.d2h_tokens, tally.h2d_tokens = model.d2h_tokens, model.h2d_tokens
    leaked = model.drain()
    if any(leaked.values()):
        raise AssertionError(f"core model leaked slots: {leaked}")
    return tally
