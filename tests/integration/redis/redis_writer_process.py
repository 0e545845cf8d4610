"""Run as a separate process by test_redis_processes.py: writes pages through RedisBackend and
prints how many were stored. Arguments: URL TENANT KV SEED PAGES."""

from __future__ import annotations

import sys

import anyio
from redis_helpers import Pages, namespace, page_keys

from hicache.backends.redis import RedisBackend


async def main(url: str, tenant: str, kv: str, seed: int, count: int) -> None:
    ns = namespace(tenant=tenant, kv=kv)
    backend = RedisBackend.from_spec(url, namespace=ns)
    stored = await backend.set_from(
        page_keys(ns, count), Pages(count).fill(seed).buffers(range(count))
    )
    await backend.aclose()
    print(stored)


if __name__ == "__main__":
    url, tenant, kv, seed, count = sys.argv[1:]
    anyio.run(main, url, tenant, kv, int(seed), int(count))
