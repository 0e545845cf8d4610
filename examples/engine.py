"""A continuous-batching engine over `TinyDecoder` with `hicache.HiCache` embedded.

One scheduler task owns every request's state; clients talk to it through a bounded queue
(`generate` sends a request and waits for its completion). Each scheduler step:

1. admit waiting requests while their reservations fit the pool: `match_many` (prefix in L1, length in L2 only, path locked), then
   `load_back_many` (L2 -> L1, with a handle whose `wait_async(layer)` the model awaits per layer);
2. grow each running request by a prefill chunk or one decode token: `allocate_many` (the
   cache evicts L1 as needed). A request that cannot get slots is preempted: `release`, then
   back to the front of the queue;
3. run one forward step over the batch (layer-major, so layer i only waits for layer i's load);
4. `cache_many`: finished requests are inserted (and become hits for later turns), requests in
   the middle of a chunked prefill insert what they have so far (no hit count; the lock moves).
   Aborted requests are released instead.

The cache is used for every request; the engine never frees or reuses a slot on its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import anyio
import numpy as np
import torch

from examples.tiny_decoder import Chunk, TinyDecoder
from hicache.cache import HiCache
from hicache.results import CapacityError
from hicache.types import RequestId

EMPTY = np.empty(0, dtype=np.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """What `Engine.generate` returns. `logits[i]` is the model's output at position
    `prefix_len + i` (only when the engine keeps logits)."""

    rid: RequestId
    tokens: tuple[int, ...]  # prompt + generated
    prompt_len: int
    generated: tuple[int, ...]
    prefix_len: int  # positions not computed: found in L1 or loaded back from L2
    device_hit: int  # tokens matched in L1
    host_hit: int  # tokens matched in L2 only
    loaded: int  # tokens loaded back from L2 (0 when below the cache's load_back_threshold)
    preempted: int  # times it lost its slots and started over
    aborted: bool = False
    logits: torch.Tensor | None = None


@dataclass(slots=True, eq=False)
class Request:
    """A request as the scheduler sees it. Owned and mutated by the scheduler task only."""

    rid: RequestId
    prompt: np.ndarray
    max_new_tokens: int
    done: anyio.Event = field(default_factory=anyio.Event)
    tokens: list[int] = field(default_factory=list)  # prompt + generated so far
    slots: np.ndarray = field(
        default_factory=lambda: EMPTY
    )  # device slots; the first `computed` hold this request's K/V
    computed: int = 0
    prefix_len: int = 0
    device_hit: int = 0
    host_hit: int = 0
    loaded: int = 0
    waits: tuple = ()  # load handles to await before the first forward reads the prefix
    preempted: int = 0
    aborted: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)
    result: Completion | None = None

    def reserve(self, page_size: int) -> int:
        """Device slots this request may hold at its end, rounded up to whole pages."""
        return -(-(len(self.prompt) + self.max_new_tokens) // page_size) * page_size

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    def reset(self) -> None:
        """Forget everything the cache handed out (after a release)."""
        self.tokens = list(self.prompt.tolist())
        self.slots, self.computed, self.waits = EMPTY, 0, ()
        self.logits.clear()


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    loaded_tokens: int = 0
    prefill_tokens: int = 0  # prompt positions computed (not found in the cache)
    decode_tokens: int = 0  # generated tokens fed back through the model
    generated_tokens: int = 0
    preemptions: int = 0
    aborted: int = 0


class Engine:
    def __init__(
        self,
        cache: HiCache,
        model: TinyDecoder,
        *,
        max_running: int = 8,
        step_tokens: int = 256,
        chunk_tokens: int = 64,
        eos: int | None = None,
        keep_logits: bool = False,
        queue_size: int = 64,
    ) -> None:
        if chunk_tokens <= 0 or step_tokens < chunk_tokens or max_running <= 0:
            raise ValueError("need 0 < chunk_tokens <= step_tokens and max_running > 0")
        self.cache, self.model = cache, model
        self.max_running, self.step_tokens, self.chunk_tokens = (
            max_running,
            step_tokens,
            chunk_tokens,
        )
        self.eos, self.keep_logits = eos, keep_logits
        self.stats = EngineStats()
        self._send, self._inbox = anyio.create_memory_object_stream[Request](queue_size)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._aborts: set[RequestId] = set()
        self._under_pressure = False  # allocate one request at a time (see _grow)
        self._next_id = 0

    # ------------------------------------------------------------------ client side
    async def generate(self, prompt, max_new_tokens: int, *, rid: str | None = None) -> Completion:
        """Queue a request and wait for it to finish (or be aborted)."""
        prompt = np.asarray(prompt, dtype=np.int64)
        if prompt.ndim != 1 or len(prompt) < 1:
            raise ValueError("prompt must be a non-empty 1-D sequence of token ids")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if rid is None:
            self._next_id += 1
            rid = f"req-{self._next_id}"
        req = Request(rid=RequestId(rid), prompt=prompt, max_new_tokens=max_new_tokens)
        req.reset()
        await self._send.send(req)
        try:
            await req.done.wait()
        except BaseException:  # the client went away (cancelled): stop working for it
            self.abort(rid)
            raise
        assert req.result is not None
        return req.result

    def abort(self, rid: str) -> None:
        """Abort a queued or running request at the next step; its `generate` returns aborted."""
        self._aborts.add(RequestId(rid))

    def close(self) -> None:
        """No more requests: `run` returns once every queued request has finished."""
        self._send.close()

    # ------------------------------------------------------------------ scheduler
    async def run(self) -> None:
        """The scheduler loop; run it in a task group beside the clients."""
        async with self._inbox:
            while True:
                open_ = self._take_arrivals()
                if not self._waiting and not self._running:
                    if not open_:
                        return
                    try:
                        self._waiting.append(await self._inbox.receive())
                    except anyio.EndOfStream:
                        return
                    continue
                await self.step()

    def _take_arrivals(self) -> bool:
        while True:
            try:
                self._waiting.append(self._inbox.receive_nowait())
            except anyio.WouldBlock:
                return True
            except anyio.EndOfStream:
                return False

    async def step(self) -> None:
        self.stats.steps += 1
        await self._abort_requested()
        await self._admit()
        batch = await self._grow()
        if not batch:
            return
        chunks = [
            Chunk(
                tokens=req.tokens[req.computed : req.computed + n],
                start=req.computed,
                slots=torch.from_numpy(req.slots[: req.computed + n]),
                waits=req.waits,
            )
            for req, n in batch
        ]
        outputs = await self.model.forward(self.cache.device_pool, chunks)
        to_cache, finished = [], []
        for (req, n), logits in zip(batch, outputs):
            req.waits = ()
            if req.prefilling:
                self.stats.prefill_tokens += n
            else:
                self.stats.decode_tokens += n
            req.computed += n
            if self.keep_logits:
                req.logits.append(logits)
            if req.prefilling:  # chunked prefill: insert progress, keep running
                to_cache.append(
                    (req.rid, req.tokens[: req.computed], req.slots[: req.computed], False)
                )
                continue
            token = int(logits[-1].argmax())
            req.tokens.append(token)
            self.stats.generated_tokens += 1
            if len(req.tokens) - len(req.prompt) >= req.max_new_tokens or token == self.eos:
                to_cache.append(
                    (req.rid, req.tokens[: req.computed], req.slots[: req.computed], True)
                )
                finished.append(req)
        outcomes = await self.cache.cache_many(to_cache) if to_cache else ()
        for (rid, _tokens, _slots, done), out in zip(to_cache, outcomes):
            if not done:  # the tree's slots now back the inserted prefix; duplicates were freed
                req = next(r for r in self._running if r.rid == rid)
                req.slots = np.concatenate([out.device_slots, req.slots[len(out.device_slots) :]])
        for req in finished:
            self._running.remove(req)
            self._complete(req)

    async def _abort_requested(self) -> None:
        if not self._aborts:
            return
        for req in [r for r in self._waiting if r.rid in self._aborts]:
            self._waiting.remove(req)
            self._complete(req, aborted=True)
        victims = [r for r in self._running if r.rid in self._aborts]
        if victims:
            await self.cache.release_many([r.rid for r in victims])
            for req in victims:
                self._running.remove(req)
                self._complete(req, aborted=True)
        self._aborts.clear()

    async def _admit(self) -> None:
        # Admission control: a request reserves every slot it may ever need (prompt plus
        # max_new_tokens, in whole pages). What running requests have not reserved is free or
        # cached and unlocked, which the cache evicts on demand, so a step rarely meets a
        # CapacityError. A request larger than the pool is admitted alone (and then aborted).
        page = self.cache.config.page_size
        room = self.cache.config.device_tokens - sum(r.reserve(page) for r in self._running)
        new = []
        while self._waiting and len(self._running) + len(new) < self.max_running:
            need = self._waiting[0].reserve(page)
            if need > room and (self._running or new):
                break
            room -= need
            new.append(self._waiting.popleft())
        if not new:
            return
        # Match all but the last prompt token: the step must compute at least one position
        # to get the logits of the next token.
        matches = await self.cache.match_many([(r.rid, r.prompt[:-1]) for r in new])
        loads = await self.cache.load_back_many([r.rid for r in new])
        for req, match, load in zip(new, matches, loads):
            req.slots = np.asarray(load.device_slots, dtype=np.int64)
            req.computed = req.prefix_len = len(req.slots)
            req.device_hit, req.host_hit, req.loaded = (
                match.device_len,
                match.host_len,
                load.loaded_tokens,
            )
            req.waits = tuple(match.pending) + ((load.handle,) if load.handle is not None else ())
            self.stats.device_hit_tokens += match.device_len
            self.stats.loaded_tokens += load.loaded_tokens
            self._running.append(req)

    async def _grow(self) -> list[tuple[Request, int]]:
        """Pick this step's work per running request and give it device slots."""
        budget, plan = self.step_tokens, []
        for req in sorted(self._running, key=lambda r: r.prefilling):  # decodes first
            n = (
                min(self.chunk_tokens, len(req.prompt) - req.computed, budget)
                if req.prefilling
                else 1
            )
            if n <= 0:
                continue
            budget -= n
            plan.append((req, n))
        wants = [(req, n) for req, n in plan]
        if self._under_pressure:
            got = await self._allocate_one_by_one(wants)
        else:
            try:
                got = await self.cache.allocate_many([(req.rid, n) for req, n in wants])
            except CapacityError:
                # The batch is not atomic: requests before the one that failed got slots we
                # never saw. Only a release gives those back, so every request of the batch
                # starts over; until a step allocates cleanly, go one request at a time.
                self._under_pressure = True
                for req, _ in reversed(wants):  # requeued at the front, in their order
                    await self._preempt(req, alone_ok=True)
                return []
        for (req, _), slots in zip(wants, got):
            if slots is not None:
                req.slots = np.concatenate([req.slots, slots])
        return [(req, n) for req, n in plan if req in self._running]

    async def _allocate_one_by_one(self, wants):
        """Under pressure: the oldest requests get slots; a request that cannot is preempted
        (released, requeued at the front) so the others can finish."""
        got, failed = [], False
        for req, n in wants:
            try:
                got.append(await self.cache.allocate(req.rid, n))
            except CapacityError:
                failed = True
                got.append(None)
                await self._preempt(req)
        self._under_pressure = failed
        return got

    async def _preempt(self, req: Request, *, alone_ok: bool = False) -> None:
        await self.cache.release(req.rid)
        self._running.remove(req)
        if not self._running and not alone_ok:  # alone and still too big: it can never run
            self._complete(req, aborted=True)
            return
        req.preempted += 1
        req.reset()
        self.stats.preemptions += 1
        self._waiting.appendleft(req)

    def _complete(self, req: Request, *, aborted: bool = False) -> None:
        stats = self.stats
        stats.requests += 1
        stats.aborted += aborted
        stats.prompt_tokens += len(req.prompt)
        req.result = Completion(
            rid=req.rid,
            tokens=tuple(req.tokens),
            prompt_len=len(req.prompt),
            generated=tuple(req.tokens[len(req.prompt) :]),
            prefix_len=req.prefix_len,
            device_hit=req.device_hit,
            host_hit=req.host_hit,
            loaded=req.loaded,
            preempted=req.preempted,
            aborted=aborted,
            logits=torch.cat(req.logits) if req.logits else None,
        )
        req.done.set()
