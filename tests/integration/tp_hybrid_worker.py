"""One tensor-parallel rank of the two-process hybrid test (run in a spawned process): the
same seeded hybrid workload on every rank, each rank keeping its own shard of the recurrent
state; rank 1's storage is slower, so the ranks' completions arrive at different times. With
`own`, the snapshots live in a states cache (`state_config`) with its own process group."""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace

import anyio
import numpy as np
import torch.distributed as dist

from hicache import CacheConfig, HiCache
from hicache.backends.file import FileBackend
from hicache.backends.keys import Namespace
from hicache.hybrid import FullAttention, HybridCache, HybridModel, Recurrent, state_config
from hicache.testing import BackendFaults, FaultyBackend
from hicache.testing.kvfill import count_bad_pages, fill
from hicache.testing.synthetic import kv_seeds

PAGE = 16
STATE = 300
MODEL = HybridModel((Recurrent((0, 2), STATE, grid=2 * PAGE), FullAttention((1,))), PAGE)


def state_of(prefix: np.ndarray, rank: int) -> bytes:
    """This rank's shard of the state after `prefix`."""
    digest = hashlib.sha256(prefix.astype(np.int64).tobytes() + bytes([rank])).digest()
    return (digest * (STATE // len(digest) + 1))[:STATE]


def workload(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, 50_000, 200) for _ in range(4)]
    return [
        np.concatenate(
            [
                bases[int(rng.integers(0, 4))][: int(rng.integers(8, 150))],
                rng.integers(0, 50_000, 20),
            ]
        )
        for _ in range(n)
    ]


def main(rank: int, world: int, init_file: str, out_dir: str, seed: int, own: bool = False) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    state_group = dist.new_group(backend="gloo")  # each cache agrees over a group of its own
    cfg = CacheConfig(
        kv="mha:1:2:8:float16",
        page_size=PAGE,
        device_tokens=640,
        host_tokens=1280,
        write_policy="write_through",
        storage="file",
        model_id="tp-hybrid",
        prefetch_threshold=PAGE,
        tp_rank=rank,
        tp_size=world,
        channel_capacity=32,
    )
    state_cfg = state_config(cfg, MODEL, device_snapshots=12, host_snapshots=24)

    def backend(c: CacheConfig) -> FaultyBackend:
        ns = Namespace(
            model=c.model_id,
            kv=c.kv,
            page_size=c.page_size,
            rank=rank,
            tp_size=world,
            layout=c.layout,
        )
        return FaultyBackend(
            FileBackend(os.path.join(out_dir, "store"), namespace=ns),
            BackendFaults(latency=0.0005 + 0.004 * rank),
        )

    @asynccontextmanager
    async def opened(kv_cfg: CacheConfig, st_cfg: CacheConfig):
        """(K/V cache, states cache or None, HybridCache), each cache on its own TP group."""
        async with AsyncExitStack() as stack:
            cache = await stack.enter_async_context(
                HiCache(kv_cfg, backend=backend(kv_cfg), tp_group=group)
            )
            states = None
            if own:
                states = await stack.enter_async_context(
                    HiCache(st_cfg, backend=backend(st_cfg), tp_group=state_group)
                )
            yield cache, states, HybridCache(cache, MODEL, states=states)

    async def run():
        hits, bad, states_dump = [], 0, None
        async with opened(cfg, state_cfg) as (cache, states, hc):
            pool = cache.device_pool
            for i, tokens in enumerate(workload(seed, 40)):
                rid = f"r{i}"
                if i % 7 == 6:
                    await hc.prefetch(rid, tokens)
                hit = await hc.match(rid, tokens)
                seeds = kv_seeds(tokens, PAGE)
                bad += count_bad_pages(pool, hit.device_slots, seeds, page_size=PAGE, first=0)
                if hit.length and hit.state != state_of(tokens[: hit.length], rank):
                    bad += 1
                fresh = await hc.allocate(rid, len(tokens) - hit.length)
                fill(pool, fresh, seeds, page_size=PAGE, first=hit.length)
                points = [p for p in MODEL.snapshot_points(len(tokens)) if p > hit.length]
                await hc.cache_finished(
                    rid,
                    tokens,
                    np.concatenate([hit.device_slots, fresh]),
                    snapshots={p: state_of(tokens[:p], rank) for p in points},
                )
                hits.append([hit.length, hit.kv_len, hit.device_hit])
                if i % 10 == 9:
                    for c in (cache, states):
                        if c is not None:
                            await c.clear(["device"])
            await cache.flush()
            dump = await cache.dump()
            if states is not None:
                await states.flush()
                states_dump = await states.dump()
        return hits, bad, dump, states_dump

    async def from_l3():
        """Fresh caches over the same store: each rank must read its own shard back."""
        read, bad = 0, 0
        wait = {"prefetch_policy": "wait_complete"}
        async with opened(replace(cfg, **wait), replace(state_cfg, **wait)) as (_, _, hc):
            for i, tokens in enumerate(workload(seed, 40)[-8:]):
                rid = f"again{i}"
                await hc.prefetch(rid, tokens)
                hit = await hc.match(rid, tokens)
                if hit.length:
                    read += 1
                    bad += hit.state != state_of(tokens[: hit.length], rank)
                await hc.release(rid)
        return read, bad

    hits, bad, dump, states_dump = anyio.run(run)
    read, bad_l3 = anyio.run(from_l3)
    bad += bad_l3
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        record = {"hits": hits, "bad": bad, "dump": dump, "states": states_dump, "read": read}
        json.dump(record, f)
    dist.destroy_process_group()
