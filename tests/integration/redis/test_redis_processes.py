"""Two processes sharing one Redis: what one writes, the other reads; another tenant salt or
another KV dtype misses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from redis_helpers import KV, Pages, namespace, page_keys

from hicache.backends.redis import RedisBackend

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def _write_in_another_process(url: str, tenant: str, seed: int, count: int) -> int:
    caller = os.environ.get("PYTHONPATH")  # kept: packages installed beside the checkout
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), str(HERE), caller) if p)
    )
    done = subprocess.run(
        [sys.executable, str(HERE / "redis_writer_process.py"), url, tenant, KV, str(seed), str(count)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


async def test_second_process_hits_what_the_first_wrote(server):
    assert _write_in_another_process(server.url, "tenant-a", seed=11, count=5) == 5
    ns = namespace(tenant="tenant-a")
    reader = RedisBackend.from_spec(server.url, namespace=ns)
    keys = page_keys(ns, 5)
    assert await reader.exists(keys) == 5
    read = Pages(5)
    assert await reader.get_into(keys, read.buffers(range(5))) == 5
    written = Pages(5).fill(seed=11)
    assert [read.page_bytes(i) for i in range(5)] == [written.page_bytes(i) for i in range(5)]
    # Same tokens under another tenant salt, or with another KV dtype: nothing shared.
    for other in (
        namespace(tenant="tenant-b"),
        namespace(tenant="tenant-a", kv="mha:2:2:8:float16"),
    ):
        stranger = RedisBackend.from_spec(server.url, namespace=other)
        assert await stranger.exists(page_keys(other, 5)) == 0
        assert await stranger.get_into(page_keys(other, 5), Pages(5).buffers(range(5))) == 0
        await stranger.aclose()
    await reader.aclose()
