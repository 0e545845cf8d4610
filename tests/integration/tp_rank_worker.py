"""One tensor-parallel rank of the two-process agreement test (run in a spawned process)."""

from __future__ import annotations

import json
import os

import anyio
import numpy as np
import torch.distributed as dist

from hicache import CacheConfig, HiCache
from hicache.backends.file import FileBackend
from hicache.backends.keys import Namespace
from hicache.testing import BackendFaults, FaultyBackend, ScriptedScheduler


def workload(seed: int, steps: int):
    """The same seeded request script on every rank: shared prefixes, varied lengths."""
    rng = np.random.default_rng(seed)
    script = []
    for step in range(steps):
        reqs = []
        for i in range(int(rng.integers(1, 4))):
            base = int(rng.integers(0, 8)) * 10_000
            length = 16 * int(rng.integers(1, 9))
            reqs.append((f"s{step}r{i}", np.arange(base, base + length, dtype=np.int64)))
        script.append(reqs)
    return script


def main(rank: int, world: int, init_file: str, out_dir: str, kv: str, seed: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")  # apart from the model's group, as the seed does
    cfg = CacheConfig(
        kv=kv,
        page_size=16,
        device_tokens=400,
        host_tokens=800,
        write_policy="write_through",
        storage="file",
        model_id="tp-test",
        prefetch_threshold=16,
        prefetch_policy="timeout",
        tp_rank=rank,
        tp_size=world,
        channel_capacity=32,
    )
    ns = Namespace(
        model=cfg.model_id,
        kv=cfg.kv,
        page_size=cfg.page_size,
        rank=rank,
        tp_size=world,
        layout=cfg.layout,
    )
    # Each rank at its own pace: slower storage on rank 1 (its uploads and prefetch reports
    # arrive later than rank 0's, so the ranks must agree before applying them).
    backend = FaultyBackend(
        FileBackend(os.path.join(out_dir, "store"), namespace=ns),
        BackendFaults(latency=0.0005 + 0.004 * rank),
    )

    async def run():
        dumps = []
        async with HiCache(cfg, backend=backend, tp_group=group) as cache:
            # Seed 1 spreads the requests over two tenants (salts): the ranks must still agree.
            salts = (lambda rid: f"tenant-{int(rid[-1]) % 2}") if seed == 1 else None
            sched = ScriptedScheduler(cache, salt_of=salts)
            for i, step in enumerate(workload(seed, 24)):
                await sched.step(i, step)
                dumps.append(await cache.dump())
            await cache.flush()
            dumps.append(await cache.dump())
            stats = dict(backend.stats())
        return dumps, stats

    dumps, stats = anyio.run(run)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"dumps": dumps, "sets": stats.get("set_ok", 0)}, f)
    dist.destroy_process_group()
