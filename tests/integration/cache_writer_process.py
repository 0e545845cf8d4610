"""Child process for the two-process L3 tests: open a production-mode `HiCache` on a storage
spec, compute and cache one request (tokens START..START+N, KV a pure function of the page),
flush it through L2 to L3, close, and print the stats as one JSON line.

    python -m tests.integration.cache_writer_process SPEC TENANT KV START N
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio

from hicache import HiCache
from tests.integration.storage_helpers import config, tokens_from, write


async def main(spec: str, tenant: str, kv: str, start: int, count: int) -> None:
    cfg = config(storage=spec, tenant=tenant, kv=kv, deterministic=False)
    async with HiCache(cfg) as cache:
        await write(cache, "writer", tokens_from(start, count))
        stats = await cache.stats()
        backend = dict(cache.backend.stats())
    print(
        json.dumps({"host_cached_tokens": stats.host.cached_tokens, "backend": backend}), flush=True
    )


def write_in_child(
    spec: str, *, tenant: str, kv: str, start: int, count: int, timeout: float = 60
) -> dict:
    """Run this module in a fresh interpreter and return what it printed; raises with the
    child's stderr when it fails (and kills it past `timeout` seconds)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.integration.cache_writer_process",
            spec,
            tenant,
            kv,
            str(start),
            str(count),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=root,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"writer process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    spec, tenant, kv, start, count = sys.argv[1:]
    anyio.run(main, spec, tenant, kv, int(start), int(count))
