"""Redis backend throughput against the raw redis.asyncio client, in the same run.

Starts its own redis-server (persistence off, loopback). For each page size it moves the same
pages, in calls of `--batch` pages, these ways:
  raw pipe   the raw client, one pipeline of plain SET / GET of the page bytes per call
  raw conc   the raw client, one plain SET / GET per page, up to `pool` in flight (blocking pool)
  hc <N>     RedisBackend.set_from / get_into (framing header, checksum, copy into the page)
             with pipeline_bytes=N: pages grouped into pipelines of at most N bytes, the
             groups concurrent (inf: one pipeline per call; 0: one call per page)
  hc auto    the backend with its default pipeline_bytes
Every way runs once per round, rounds interleaved so machine noise hits all alike; the table
shows each way's best round in GB/s (the least disturbed by other processes, as timeit
advises) and the ratio of `hc auto` to the faster raw way of the same round, median over
rounds (target >= 0.9).

    /work/main/.venv/bin/python bench/storage_redis.py [--sizes 16,64,256,1024,4096] [--mib 16] [--rounds 9]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache.backends.keys import Namespace
from hicache.backends.redis import RedisBackend
from hicache.backends.redis.spec import DEFAULT_PIPELINE_BYTES
from hicache.testing.redis_server import RedisServer, redis_server_binary

Call = Callable[[range], Awaitable[None]]


def _keys(ns: Namespace, count: int) -> list[str]:
    return [ns.key(hashlib.sha256(b"%d" % i).hexdigest()) for i in range(count)]


def _raw_calls(client: aioredis.Redis, keys, pages, pool: int) -> dict[str, tuple[Call, Call]]:
    permits = anyio.Semaphore(pool)

    async def pipe(chunk: range, write: bool) -> None:
        p = client.pipeline(transaction=False)
        for i in chunk:
            p.execute_command("SET", keys[i], pages[i]) if write else p.execute_command(
                "GET", keys[i]
            )
        await p.execute()

    async def conc(chunk: range, write: bool) -> None:
        async def one(i: int) -> None:
            async with permits:
                if write:
                    await client.execute_command("SET", keys[i], pages[i])
                else:
                    await client.execute_command("GET", keys[i])

        async with anyio.create_task_group() as group:
            for i in chunk:
                group.start_soon(one, i)

    return {
        "raw pipe": (lambda c: pipe(c, True), lambda c: pipe(c, False)),
        "raw conc": (lambda c: conc(c, True), lambda c: conc(c, False)),
    }


def _backend_calls(backend: RedisBackend, keys, pages, targets) -> tuple[Call, Call]:
    async def upload(chunk: range) -> None:
        n = await backend.set_from([keys[i] for i in chunk], [[pages[i]] for i in chunk])
        assert n == len(chunk), f"set_from stored {n} of {len(chunk)}"

    async def prefetch(chunk: range) -> None:
        n = await backend.get_into([keys[i] for i in chunk], [targets[i] for i in chunk])
        assert n == len(chunk), f"get_into read {n} of {len(chunk)}"

    return upload, prefetch


async def run(url: str, args: argparse.Namespace) -> list[tuple[int, str, float]]:
    """Print the table; return (page KiB, op, ratio of `hc auto` to the faster raw way) rows."""
    pool = args.pool
    raw = aioredis.Redis.from_pool(
        aioredis.BlockingConnectionPool.from_url(url, max_connections=pool, timeout=10)
    )
    strategies = {f"hc {b}": b for b in args.strategies.split(",")} | {"hc auto": None}
    print(
        f"redis-server {url}; {args.mib} MiB per size and op, calls of {args.batch} pages, "
        f"pool {pool}, {args.rounds} interleaved rounds (GB/s: best; ratio: median per round); "
        f"default pipeline_bytes={DEFAULT_PIPELINE_BYTES}"
    )
    names = ["raw pipe", "raw conc", *strategies]
    print(f"{'page':>7} | {'op':>8} | " + " | ".join(f"{n:>9}" for n in names) + " | ratio")
    ratios: list[tuple[int, str, float]] = []
    for size_kib in (int(s) for s in args.sizes.split(",")):
        size = size_kib * 1024
        count = max(args.batch, args.mib * 1024 * 1024 // size)
        blobs = [os.urandom(size) for _ in range(min(count, 64))]
        pages = [memoryview(blobs[i % len(blobs)]) for i in range(count)]
        targets = [[memoryview(bytearray(size))] for _ in range(count)]
        chunks = [range(i, min(i + args.batch, count)) for i in range(0, count, args.batch)]
        raw_ns = Namespace(
            model="bench", kv="mha:1:1:8:uint8", page_size=1, tenant=f"raw/{size_kib}"
        )
        ways = _raw_calls(raw, _keys(raw_ns, count), pages, pool)
        backends = []
        for name, setting in strategies.items():
            options = (
                {}
                if setting is None
                else {"pipeline_bytes": 1 << 50 if setting == "inf" else int(setting)}
            )
            ns = Namespace(
                model="bench", kv="mha:1:1:8:uint8", page_size=1, tenant=f"{name}/{size_kib}"
            )
            backend = RedisBackend.from_spec(url, namespace=ns, pool=pool, timeout=10, **options)
            backends.append(backend)
            ways[name] = _backend_calls(backend, _keys(ns, count), pages, targets)
        for op_index, op in enumerate(("upload", "prefetch")):
            times: dict[str, list[float]] = {name: [] for name in ways}
            for round_index in range(args.rounds + 1):  # round 0 warms up
                for name, calls in ways.items():
                    start = time.perf_counter()
                    for chunk in chunks:
                        await calls[op_index](chunk)
                    if round_index:
                        times[name].append(time.perf_counter() - start)
            gbs = {name: size * count / min(t) / 1e9 for name, t in times.items()}
            # per round: the faster raw way's time over hc auto's, then the median over rounds
            # (drift between rounds cancels within a round; one lucky round cannot decide it)
            ratio = statistics.median(
                min(p, c) / h
                for p, c, h in zip(times["raw pipe"], times["raw conc"], times["hc auto"])
            )
            ratios.append((size_kib, op, ratio))
            print(
                f"{size_kib:>5}Ki | {op:>8} | "
                + " | ".join(f"{gbs[n]:9.2f}" for n in names)
                + f" | {ratio:5.2f}"
            )
        assert all(
            bytes(targets[i][0]) == bytes(pages[i]) for i in range(0, count, max(1, count // 8))
        )
        for backend in backends:
            await backend.aclose()
        await raw.flushdb()
    await raw.aclose()
    return ratios


def main(argv: list[str] | None = None) -> list[tuple[int, str, float]]:
    """Run the comparison (bench/storage.py --backends redis calls this); returns run()'s rows."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--sizes", default="16,64,256,1024,4096", help="page sizes in KiB")
    parser.add_argument("--mib", type=int, default=16, help="MiB moved per size, op and way")
    parser.add_argument("--batch", type=int, default=32, help="pages per call")
    parser.add_argument("--pool", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--strategies", default="inf,0", help="pipeline_bytes values to compare")
    args = parser.parse_args(argv)
    if redis_server_binary() is None:
        sys.exit("redis-server is not installed (apt-get install redis-server)")
    with (
        tempfile.TemporaryDirectory(prefix="bench-redis-") as tmp,
        RedisServer(Path(tmp)) as server,
    ):
        return anyio.run(run, server.url, args)


if __name__ == "__main__":
    main()
