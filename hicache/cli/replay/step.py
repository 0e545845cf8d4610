"""One scheduler step of `hicache replay` (the batched path): match, prefetch, load back
(verified), allocate, compute, insert, and pin first blocks when asked."""

from __future__ import annotations

import time

import numpy as np

from hicache.cache import HiCache
from hicache.cli.tally import Tally
from hicache.cli.trace import TraceRequest
from hicache.radix.hashes import chain_page_hashes
from hicache.results import LoadBackOutcome, MatchOutcome, PinLimitError
from hicache.testing.kvfill import count_bad_pages, fill, page_seeds
from hicache.types import RequestId

__all__ = ["Timer", "run_step"]


class Timer:
    """Accumulates the time spent inside cache calls (the control plane), in all and by call
    (`with timer("match"):`; a bare `with timer:` counts as "other")."""

    def __init__(self, tally: Tally) -> None:
        self._tally = tally
        self._name = "other"

    def __call__(self, name: str) -> Timer:
        self._name = name
        return self

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        took = time.perf_counter() - self._t0
        tally = self._tally
        tally.control_s += took
        tally.control_by_call[self._name] = tally.control_by_call.get(self._name, 0.0) + took
        self._name = "other"


async def run_step(
    cache: HiCache,
    step: list[TraceRequest],
    tally: Tally,
    timer: Timer,
    block_tokens: int,
    verify: bool,
    storage_on: bool,
    salts: int = 0,
    pin_first_block: tuple[str, ...] = (),
) -> None:
    """One scheduler step: match, prefetch, load back (verified), allocate, compute, insert.
    With `salts`, request i runs under salt `salt-{i % salts}` (tenants sharing the cache);
    with `pin_first_block`, each request's first block (its system prompt, in the trace's
    terms) is pinned in those tiers once cached."""
    page = cache.config.page_size
    pool = cache.device_pool
    toks = {RequestId(f"r{r.index}"): r.tokens(block_tokens) for r in step}
    salt = {RequestId(f"r{r.index}"): f"salt-{r.index % salts}" if salts else None for r in step}
    # One seed per whole page, plus one for a partial last page (computed, never cached).
    # Without verification nothing reads the KV's content: the stand-in model writes none
    # (the transfers still move every byte).
    seeds = (
        {
            rid: np.append(page_seeds(chain_page_hashes(t[: len(t) // page * page], page)), 0)
            for rid, t in toks.items()
        }
        if verify
        else {}
    )
    with timer("match"):
        matches = await cache.match_many((rid, t, salt[rid]) for rid, t in toks.items())
    if storage_on:
        with timer("prefetch"):
            await cache.prefetch_many((rid, t, salt[rid]) for rid, t in toks.items())
            for rid in toks:
                await cache.prefetch_wait(rid)
    # Load back what L2 holds, as a scheduler does: only for requests whose match left some
    # of it in L2 or has a load landing on it. Without L3 nothing can add to L2 since the
    # match; with L3 the prefetch may have, so every request asks.
    asks = [m.rid for m in matches if storage_on or m.host_len or m.pending]
    with timer("load_back"):
        loaded = {lb.rid: lb for lb in (await cache.load_back_many(asks) if asks else ())}
    loads = [loaded.get(m.rid) or _no_load(m) for m in matches]
    tally.loaded += sum(lb.loaded_tokens for lb in loads)
    bad = verified = 0
    for lb in loads:
        if lb.handle is not None:
            await lb.handle.wait_async(pool.geometry.layers - 1)
            first = len(lb.device_slots) - lb.loaded_tokens
            if verify:
                bad += count_bad_pages(
                    pool, lb.device_slots[first:], seeds[lb.rid], page_size=page, first=first
                )
                verified += lb.loaded_tokens // page
    with timer("allocate"):
        news = await cache.allocate_many(
            (lb.rid, len(toks[lb.rid]) - len(lb.device_slots)) for lb in loads
        )
    items = []
    for lb, new in zip(loads, news):
        if verify:
            fill(pool, new, seeds[lb.rid], page_size=page, first=len(lb.device_slots))
        slots = np.concatenate([lb.device_slots, new])
        items.append((lb.rid, toks[lb.rid], slots, True, salt[lb.rid]))
    with timer("cache"):
        await cache.cache_many(items)
        if pin_first_block:
            await _pin_first_blocks(cache, step, toks, salt, block_tokens, pin_first_block, tally)
    tally.device_hit += sum(m.device_len for m in matches)
    if salts:
        for m, lb in zip(matches, loads):
            counts = tally.per_salt.setdefault(salt[m.rid] or "", [0, 0])
            counts[0] += len(toks[m.rid])
            counts[1] += m.device_len + lb.loaded_tokens
    tally.corrupt_pages += bad
    tally.verified_pages += verified
    tally.requests += len(step)
    tally.input_tokens += sum(len(t) for t in toks.values())


def _no_load(match: MatchOutcome) -> LoadBackOutcome:
    """What load_back would answer for a request whose match left nothing in L2."""
    return LoadBackOutcome(rid=match.rid, device_slots=match.device_slots, loaded_tokens=0)


async def _pin_first_blocks(
    cache: HiCache,
    step: list[TraceRequest],
    toks: dict[RequestId, np.ndarray],
    salt: dict[RequestId, str | None],
    block_tokens: int,
    tiers: tuple[str, ...],
    tally: Tally,
) -> None:
    page = cache.config.page_size
    for req in step:
        rid = RequestId(f"r{req.index}")
        first = min(block_tokens, len(toks[rid])) // page * page
        block = (salt[rid], req.hash_ids[0]) if req.hash_ids else None
        if not first or block is None or block in tally.pinned:
            continue
        try:
            await cache.pin(toks[rid][:first], tiers=tiers, salt=salt[rid])
        except PinLimitError:
            tally.pins_refused += 1
        else:
            tally.pinned.add(block)
