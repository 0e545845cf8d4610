"""One seed's workload: its clients and their requests (`RequestSpec`), drawn by
`generate_workload` as a pure function of the config."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from hicache.results import Retention
from hicache.testing.simulation.config import SimConfig, pick


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload.

    `tokens` is the whole sequence (prompt, then the tokens "generated" by decode steps);
    `match_len` how many are matched (the prompt, or all but its last token); `chunks` the
    positions where compute stops (chunked prefill, then one per decode step); `unfinished_at`
    the subset of those where the request is inserted with `cache_unfinished`. `prefetch`:
    none | wait | poll | nowait. `fate`: finish (cache_finished) | finish_then_poke (then a
    call on the ended request, which must raise UnknownRequest) | wrong_tokens (first a
    cache_finished whose tokens differ inside the matched prefix, which must raise a
    ValueError and change nothing) | rematch (a shorter match
    first) | release_after_match | release_mid_prefetch (release while its prefetch runs) |
    release_mid_load (release after load_back, before the load landed) | release_mid_compute |
    abandon (drop the request without a release at `abandon_at`: match | load | compute; the
    close must clean it up). `think`: seconds the client waits before it."""

    rid: str
    tokens: np.ndarray
    prompt_len: int
    match_len: int
    chunks: tuple[int, ...]
    unfinished_at: frozenset[int]
    prefetch: str
    fate: str
    abandon_at: str
    think: float
    alloc_batches: int  # allocate a chunk in this many calls (1 or 2)
    retention: tuple[Retention, ...] = ()  # ranges given at its match
    # after it finished: pin its first `pin[0]` tokens in tiers `pin[1]` for `pin[2]` seconds
    pin: tuple[int, tuple[str, ...], float | None] | None = None
    unpin: bool = False  # after it finished: unpin its first page (often no pin: False back)


@dataclass(frozen=True)
class Workload:
    clients: tuple[tuple[RequestSpec, ...], ...]

    @property
    def requests(self) -> list[RequestSpec]:
        return [r for client in self.clients for r in client]


def generate_workload(sim: SimConfig, *, skip: Iterable[str] = ()) -> Workload:
    """The seed's clients and their requests (a pure function of the config)."""
    skip = set(skip)
    rng = np.random.default_rng([sim.seed, 2])
    page = sim.page_size
    capacity = sim.cache["device_tokens"]
    max_len = max(page + 2, capacity * 3 // 4)
    stems = [
        rng.integers(0, sim.alphabet, size=int(rng.integers(0, max_len * 3 // 4 + 1)))
        for _ in range(3)
    ]
    weights = {
        "finish": 40,
        "finish_then_poke": 5,
        "wrong_tokens": 3,
        "rematch": 5,
        "release_after_match": 4,
        "release_mid_prefetch": 8 if sim.storage != "none" else 0,
        "release_mid_load": 12,
        "release_mid_compute": 6,
        "abandon": 3,
    }
    for name in skip:
        weights.pop(name, None)
    fates = list(weights)
    probs = np.array([weights[k] for k in fates], dtype=float)
    probs /= probs.sum()
    # Conversations shared by every client: a request extends one (its next turn), repeats
    # it (a retry, a regenerate), or starts it over from a shared stem. Their total outgrows
    # L1 and often L2, so pages keep moving down the tiers and coming back.
    conversations = [
        stems[int(rng.integers(len(stems)))][: max_len // 2].copy()
        for _ in range(int(rng.integers(2, 7)))
    ]
    per_client: list[list[RequestSpec]] = [[] for _ in range(sim.clients)]
    abandoned = [False] * sim.clients
    for i in range(sim.requests):
        for c in range(sim.clients):
            k = int(rng.integers(len(conversations)))
            conv = conversations[k]
            roll = rng.random()
            if roll < 0.2 and len(conv):  # the same conversation again
                tokens = conv
            else:
                if roll > 0.85 or len(conv) >= max_len - 1:  # start over from a stem
                    stem = stems[int(rng.integers(len(stems)))]
                    conv = stem[: int(rng.integers(0, len(stem) + 1))]
                extra = int(rng.integers(1, max(2, min(max_len - len(conv), max_len // 2) + 1)))
                tokens = np.concatenate([conv, rng.integers(0, sim.alphabet, size=extra)])
            tokens = tokens.astype(np.int64)
            conversations[k] = tokens
            decode = int(rng.integers(0, min(2, len(tokens) - 1) + 1))
            prompt_len = len(tokens) - decode
            match_len = prompt_len - 1 if prompt_len > 1 and rng.random() < 0.5 else prompt_len
            cuts = {
                int(x)
                for x in rng.integers(1, max(2, len(tokens)), size=int(rng.integers(0, 3)))
                if x < len(tokens)
            }
            chunks = tuple(sorted(cuts | set(range(prompt_len, len(tokens) + 1)) | {len(tokens)}))
            unfinished = frozenset(x for x in chunks if x < len(tokens) and rng.random() < 0.5)
            fate = fates[int(rng.choice(len(fates), p=probs))]
            if fate == "abandon":
                if abandoned[c]:
                    fate = "finish"
                abandoned[c] = True
            prefetch = "none"
            if sim.storage != "none":
                prefetch = pick(rng, ("none", "wait", "wait", "wait", "poll", "nowait"))
                if fate == "release_mid_prefetch":
                    prefetch = "nowait"
            retention: tuple[Retention, ...] = ()
            if rng.random() < 0.2:  # a range of its tokens kept (or dropped) ahead of LRU
                a = int(rng.integers(0, len(tokens)))
                b = int(rng.integers(a + 1, len(tokens) + 1))
                retention = (
                    Retention(
                        a,
                        b if rng.random() < 0.8 else None,
                        int(rng.integers(0, 101)),
                        pick(rng, (None, 0.05, 0.5)),
                    ),
                )
            pin = None
            if rng.random() < 0.06 and prompt_len >= page:
                pin = (
                    int(rng.integers(1, prompt_len // page + 1)) * page,
                    pick(rng, (("device",), ("host",), ("device", "host"))),
                    pick(rng, (None, 0.1, 1.0)),
                )
            per_client[c].append(
                RequestSpec(
                    rid=f"c{c}r{i}",
                    tokens=tokens,
                    prompt_len=prompt_len,
                    match_len=match_len,
                    chunks=chunks,
                    unfinished_at=unfinished,
                    prefetch=prefetch,
                    fate=fate,
                    abandon_at=pick(rng, ("match", "load", "compute")),
                    think=float(rng.exponential(0.02)),
                    alloc_batches=1 + int(rng.random() < 0.2),
                    retention=retention,
                    pin=pin,
                    unpin=bool(rng.random() < 0.04) and len(tokens) >= page,
                )
            )
    clients = [tuple(r) for r in per_client]
    return Workload(tuple(clients))
