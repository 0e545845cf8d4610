"""What a secret costs in L3: upload (set_from) and prefetch (get_into) GB/s of each backend
plain, keyed with value tags (HMAC-SHA-256), and encrypted (AES-256-GCM), in the same run.

Each round writes a fresh key range and reads it all back (bytes verified), as
bench/storage.py's `run_case`; plain, tag and encrypted rounds alternate so the three see the
same machine state, and the medians are compared. The ratio is sealed GB/s / plain GB/s.
Backends: memory, file (a temporary directory, RAM-backed /dev/shm by default) and redis
(its own redis-server, when one is installed).

Run: python bench/storage_sealed.py [--backends memory file redis] [--pages N] [--repeats R]
     [--layers L] [--dir DIR]    (also: python bench/storage.py --backends sealed)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.storage import BenchLayout, CaseResult, Shape, run_case
from hicache.backends.base import StorageBackend
from hicache.backends.keys import Namespace
from hicache.backends.sealing.backend import seal_backend
from hicache.seal import Seal

SECRET = b"bench-secret-of-32-bytes-exactly"
MODES = ("plain", "tag", "aes-gcm")


def _namespace(base: Namespace, mode: str) -> Namespace:
    if mode == "plain":
        return base
    return dataclasses.replace(base, seal=Seal(SECRET, encrypt=mode == "aes-gcm"))


async def _measure(
    open_inner: Callable[[Namespace], StorageBackend], layout: BenchLayout, repeats: int
) -> dict[str, CaseResult]:
    base = layout.namespace
    backends = {}
    for mode in MODES:
        ns = _namespace(base, mode)
        backends[mode] = (ns, seal_backend(open_inner(ns), ns))
    runs: dict[str, list[CaseResult]] = {mode: [] for mode in MODES}
    try:
        for r in range(repeats):
            for mode, (ns, backend) in backends.items():
                layout.namespace = ns
                runs[mode].append(await run_case(backend, layout, round_=r))
                await backend.clear()
    finally:
        layout.namespace = base
        for _, backend in backends.values():
            await backend.aclose()
    med = statistics.median
    return {
        mode: CaseResult(med(x.set_gbps for x in rs), med(x.get_gbps for x in rs))
        for mode, rs in runs.items()
    }


def _openers(name: str, args: argparse.Namespace, stack: list[Callable[[], None]]) -> Any:
    if name == "memory":
        from hicache.backends.memory import MemoryBackend

        return lambda ns: MemoryBackend(namespace=ns)
    if name == "file":
        from hicache.backends.file import FileBackend

        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        root = tempfile.mkdtemp(prefix="hicache-bench-sealed-", dir=args.dir or shm)
        stack.append(lambda: shutil.rmtree(root, ignore_errors=True))
        return lambda ns: FileBackend(root, namespace=ns, threads=args.threads)
    from hicache.backends.redis import RedisBackend
    from hicache.testing.redis_server import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        print("  redis-server is not installed: skipped")
        return None
    tmp = tempfile.mkdtemp(prefix="hicache-bench-redis-")
    server = RedisServer(Path(tmp)).start()
    stack.append(lambda: (server.stop(), shutil.rmtree(tmp, ignore_errors=True)))
    return lambda ns: RedisBackend.from_spec(server.url, namespace=ns, timeout=30)


def main(argv: list[str] | None = None) -> list[tuple[str, str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--backends", nargs="+", choices=("memory", "file", "redis"), default=["file", "redis"]
    )
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--dir", default=None, help="file backend's directory (default: /dev/shm)")
    args = ap.parse_args(argv)
    shape = Shape(layers=args.layers)
    layout = BenchLayout(shape, args.pages)
    print(
        f"page {shape.page_bytes / 2**20:.1f} MiB ({2 * shape.layers} pieces), {args.pages} pages "
        f"per pass, batches of 16, median of {args.repeats}; modes alternate within each repeat"
    )
    rows: list[tuple[str, str, float]] = []
    for name in dict.fromkeys(args.backends):
        cleanup: list[Callable[[], None]] = []
        try:
            opener = _openers(name, args, cleanup)
            if opener is None:
                continue
            result = anyio.run(_measure, opener, layout, args.repeats)
        finally:
            for undo in cleanup:
                undo()
        plain = result["plain"]
        for mode in MODES:
            r = result[mode]
            up, pre = r.set_gbps / plain.set_gbps, r.get_gbps / plain.get_gbps
            print(
                f"{name:7s} {mode:8s} upload {r.set_gbps:6.2f} GB/s ({up:4.2f}x)  "
                f"prefetch {r.get_gbps:6.2f} GB/s ({pre:4.2f}x)"
            )
            if mode != "plain":
                rows += [(name, f"upload {mode}", up), (name, f"prefetch {mode}", pre)]
    return rows


if __name__ == "__main__":
    main()
