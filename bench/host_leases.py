"""How soon a cache serves after it starts opening: the host pool prepared in chunks and leased
as they become ready (`host_chunk_bytes`), against the whole pool prepared before open returns
(`host_chunk_bytes=0`), alternated in the same run.

    python bench/host_leases.py                      # 2 GiB of L2, 256 MiB chunks
    python bench/host_leases.py --host-gib 4 --chunk-mib 128 --reps 5

Each rep opens a cache (production mode, CPU pools), serves one request (match, allocate,
cache_finished) and records: `first` = seconds from the start of `HiCache.__aenter__` to that
request's answer; `whole` = seconds until the allocator's `allocator.host_ready` event (all of
L2 usable). Without CUDA nothing is pinned: preparing a chunk is its first touch alone. The
geometry is Llama-3-8B's KV (128 KiB a token).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from hicache import CacheConfig, HiCache
from hicache.observability import EventLog

KV = "mha:32:8:128:bfloat16"
BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2


async def one_open(cfg: CacheConfig) -> tuple[float, float]:
    log = EventLog()
    ready = anyio.Event()
    done: dict[str, float] = {}

    def on_event(event: dict[str, Any]) -> None:
        if event["event"] == "allocator.host_ready":
            done["whole"] = time.perf_counter()
            ready.set()

    log.add_listener(on_event)
    start = time.perf_counter()
    async with HiCache(cfg, log=log) as cache:
        tokens = np.arange(cfg.page_size * 4, dtype=np.int64)
        await cache.match("r", tokens)
        slots = await cache.allocate("r", len(tokens))
        await cache.cache_finished("r", tokens, slots)
        first = time.perf_counter() - start
        with anyio.fail_after(600):
            await ready.wait()
    return first, done["whole"] - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host-gib", type=float, default=2.0)
    parser.add_argument("--chunk-mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    page = 16
    host_tokens = int(args.host_gib * (1 << 30)) // BYTES_PER_TOKEN // page * page
    base = CacheConfig(
        kv=KV,
        device="cpu",
        page_size=page,
        device_tokens=1024,
        host_tokens=host_tokens,
        write_policy="write_through",
    )
    runs = {
        "chunked": CacheConfig(**{**_fields(base), "host_chunk_bytes": args.chunk_mib << 20}),
        "whole": CacheConfig(**{**_fields(base), "host_chunk_bytes": 0}),
    }
    print(
        f"L2 {host_tokens * BYTES_PER_TOKEN / 2**30:.2f} GiB ({host_tokens} tokens of {KV}), "
        f"chunks of {args.chunk_mib} MiB; {args.reps} reps, alternated"
    )
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, cfg in runs.items():
            times[name].append(anyio.run(one_open, cfg, backend="asyncio"))
    print(f"{'':<8} {'first served s':>15} {'all of L2 s':>12}")
    for name, rows in times.items():
        firsts, wholes = zip(*rows)
        print(f"{name:<8} {statistics.median(firsts):>15.3f} {statistics.median(wholes):>12.3f}")
    ratios = [w[0] / c[0] for w, c in zip(times["whole"], times["chunked"])]
    print(
        "ratio (whole / chunked, time to the first served request): "
        f"median {statistics.median(ratios):.2f}, min {min(ratios):.2f}, max {max(ratios):.2f}"
    )


def _fields(cfg: CacheConfig) -> dict[str, Any]:
    return {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}


if __name__ == "__main__":
    main()
