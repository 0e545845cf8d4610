"""The tree actor's prefetch flow (L3 -> L2).

A part of `TreeActor` (a mixin over its state). An op goes: admitted (threshold, anchor with a
host copy, rate limit) -> probed by the prefetcher -> host slots for exactly the pages storage
has (or revoked below the threshold) -> read -> *settled* (what arrived is inserted as host-only
nodes below the anchor and the request's waiters are answered) -> *ended* (the prefetcher no
longer touches its host slots; the rest are freed, the credit returns). Every step after the
start is taken on agreed reports (see `completions.py`), so all TP ranks take it alike.
"""

from __future__ import annotations

from hicache.backends.keys import chain_page_hashes
from hicache.components.tree.records import PrefetchOp
from hicache.messages import ReadPrefetch, StartPrefetch, StopPrefetch, TimerFired
from hicache.results import PrefetchOutcome
from hicache.types import EMPTY_SLOTS, OpId, RequestId


class PrefetchFlows:
    async def _prefetch_batch(self, items) -> tuple[PrefetchOutcome, ...]:
        self._check_rids([item.rid for item in items], "prefetch")
        keys = []
        for item in items:
            self._state(item.rid, "prefetch")
            keys.append(self._check_tokens(item.tokens))
        return tuple([await self._start_prefetch(item.rid, key)
                      for item, key in zip(items, keys)])

    async def _start_prefetch(self, rid: RequestId, tokens) -> PrefetchOutcome:
        state = self._state(rid, "prefetch")
        if not self.storage_on or rid in self._prefetch_by_rid:
            return self._prefetch_outcome(rid, self._prefetch_by_rid.get(rid))
        page = self._cfg.page_size
        matched = len(state.prefix_slots) + state.host_len
        end = len(tokens) // page * page
        length = end - matched
        anchor = state.last_node
        reason = None
        if anchor is None or not self._tree.has_host_copy(anchor):
            reason = "anchor_without_host_copy"
        elif length < self._cfg.effective_prefetch_threshold:
            reason = "below_threshold"
        elif self._prefetch_tokens + length > self._rate_limit() or self._prefetch_credits == 0:
            reason = "rate_limited"
        if reason is not None:
            self.log.info("tree.prefetch_skipped", rid=rid, tokens=max(length, 0), reason=reason)
            state.prefetch = PrefetchOutcome(rid=rid, state="skipped", reason=reason)
            return state.prefetch  # what a later wait or poll reports too
        prior = None if anchor == self._tree.root else self._node_hashes(anchor)[-1]
        new_tokens = tokens[matched:end]
        hashes = tuple(chain_page_hashes(new_tokens, page, prior=prior))
        op_id = self._op()
        timer = None
        if self._cfg.prefetch_policy == "timeout":
            timeout = self._cfg.prefetch_timeout(length)
            deliver = self.inbox.send_nowait  # a reserved slot per op: never blocks
            timer = self.kernel.call_later(timeout, lambda op=op_id: deliver(TimerFired(op=op)))
        self._tree.protect_host(anchor)
        self._prefetches[op_id] = PrefetchOp(rid=rid, anchor=anchor, tokens=new_tokens,
                                             hashes=hashes, host_slots=EMPTY_SLOTS, timer=timer)
        self._prefetch_by_rid[rid] = op_id
        self._prefetch_credits -= 1
        self._prefetch_tokens += length
        await self._prefetcher.send(StartPrefetch(op=op_id, hashes=hashes))
        self.log.info("tree.prefetch_started", rid=rid, op=op_id, tokens=length)
        return self._prefetch_outcome(rid, op_id)

    def _rate_limit(self) -> int:
        spare = self._cfg.host_capacity - self._cfg.device_tokens
        return int(self._cfg.prefetch_rate_fraction * spare)

    def _prefetch_outcome(self, rid: RequestId, op_id: OpId | None) -> PrefetchOutcome:
        if op_id is None:
            state = self._requests.get(rid)
            if state is not None and state.prefetch is not None:
                return state.prefetch
            return PrefetchOutcome(rid=rid, state="none")
        op = self._prefetches[op_id]
        page = self._cfg.page_size
        return PrefetchOutcome(
            rid=rid, state=op.state, hit_tokens=max(op.hit_pages, 0) * page,
            done_tokens=op.done_pages * page, wanted_tokens=len(op.hashes) * page,
        )

    def _prefetch_wait(self, rid: RequestId, reply, *, poll: bool) -> None:
        """Answer now if the prefetch is over; else (best_effort) stop it and take what has
        arrived, or park the reply until the policy lets it end. With `poll` (TP ranks, which
        may only change state at sync points) the current outcome is answered at once."""
        op_id = self._prefetch_by_rid.get(rid)
        if op_id is None or self._prefetches[op_id].state != "running":
            reply.set(self._prefetch_outcome(rid, op_id))
            return
        if self._cfg.prefetch_policy == "best_effort":
            self._stop_prefetch(op_id)  # take what has arrived; the stop report answers
        if poll:
            reply.set(self._prefetch_outcome(rid, op_id))
        else:
            self._prefetches[op_id].waiters.append(reply)

    def _stop_prefetch(self, op_id: OpId) -> None:
        op = self._prefetches[op_id]
        if not op.stopping:
            op.stopping = True
            self._prefetcher.send_nowait(StopPrefetch(op=op_id))

    async def _prefetch_agreed(self, op_id: OpId, *, hit: int, done: int, finished: bool,
                               stopped: bool, timed_out: bool) -> None:
        """Take the next steps of a prefetch on values every rank agreed on: `hit` pages in
        storage (-1: not probed everywhere yet), `done` pages read everywhere, `finished`
        everywhere, `stopped` acknowledged everywhere, `timed_out` somewhere."""
        op = self._prefetches[op_id]
        if op.state == "running":
            if timed_out and not op.stopping:
                self.log.info("tree.prefetch_timeout", rid=op.rid, op=op_id)
                self._stop_prefetch(op_id)
            op.hit_pages, op.done_pages = hit, done
            if hit >= 0 and hit * self._cfg.page_size < self._cfg.effective_prefetch_threshold:
                self._stop_prefetch(op_id)  # not worth it: revoke
                await self._settle_prefetch(op_id, revoked=True)
            elif finished or stopped:  # stopped: asked for, or its storage call timed out
                op.stopping = True
                await self._settle_prefetch(op_id, revoked=False)
            elif hit >= 0 and not op.reading and not op.stopping:
                op.reading = True
                await self._read_prefetch(op_id)
        if finished:
            await self._end_prefetch(op_id)

    async def _read_prefetch(self, op_id: OpId) -> None:
        """After the probe: host slots for exactly the pages storage has, then the reads."""
        op = self._prefetches[op_id]
        host = await self._alloc_host(op.hit_pages * self._cfg.page_size)
        if host is None or op.state != "running" or op.stopping:
            self._free("host", EMPTY_SLOTS if host is None else host)
            if op.state == "running":
                self.log.info("tree.prefetch_skipped", rid=op.rid, reason="host_full",
                              tokens=op.hit_pages * self._cfg.page_size)
                self._stop_prefetch(op_id)
                await self._settle_prefetch(op_id, revoked=True)
            return
        op.host_slots = host
        await self._prefetcher.send(ReadPrefetch(op=op_id, host_slots=host))

    async def _settle_prefetch(self, op_id: OpId, *, revoked: bool) -> None:
        """Hand the request what has arrived: insert it as host-only nodes below the anchor,
        answer the waiters. The slots of those pages become the tree's; the rest stay the op's
        until it ends."""
        op = self._prefetches[op_id]
        page = self._cfg.page_size
        done = 0 if revoked else min(op.done_pages, len(op.host_slots) // page)
        op.done_pages = done
        used_tokens = done * page
        if done:
            inserted = self._tree.insert_host(
                op.anchor, op.tokens[:used_tokens], op.host_slots[:used_tokens],
                op.hashes[:done], now=self._now(),
            )
            self._free("host", inserted.duplicate_slots)
        self._tree.release_host(op.anchor)
        op.state = "revoked" if revoked else "done"
        self.log.info("tree.prefetch_done", rid=op.rid, op=op_id, state=op.state,
                      hit=max(op.hit_pages, 0) * page, read=used_tokens)
        outcome = self._prefetch_outcome(op.rid, op_id)
        state = self._requests.get(op.rid)
        if state is not None:
            state.prefetch = outcome
            if done:
                self.counters.storage_hit_tokens += used_tokens
            # Lock what arrived for the request, unless it is past load_back (or allocated):
            # then its prefix is fixed, and moving it would misalign what it holds.
            if done and not state.loaded_back and not state.owned:
                self._rematch(state)
        for reply in op.waiters:
            reply.set(outcome)
        op.waiters.clear()
        del self._prefetch_by_rid[op.rid]

    async def _end_prefetch(self, op_id: OpId) -> None:
        """The prefetcher is done with the op: free the slots the tree did not take."""
        op = self._prefetches.pop(op_id)
        self._prefetch_reports.pop(op_id, None)
        self._timers_fired.discard(op_id)
        if op.timer is not None:
            op.timer.cancel()
        page = self._cfg.page_size
        self._free("host", op.host_slots[op.done_pages * page:])
        self._prefetch_tokens -= len(op.hashes) * page
        self._prefetch_credits += 1
