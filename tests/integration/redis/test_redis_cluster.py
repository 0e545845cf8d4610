"""RedisBackend over a three-master Redis Cluster: keys spread over every shard, batches that
cross shards, clear on every primary, and a lost shard as misses and an event."""

from __future__ import annotations

import anyio
import pytest
import redis
from redis_helpers import Pages, namespace, page_keys

from hicache.backends.redis import RedisBackend
from hicache.testing.redis_server import RedisClusterServers

pytestmark = [pytest.mark.redis, pytest.mark.anyio]


def _keys_per_node(cluster: RedisClusterServers) -> list[int]:
    counts = []
    for node in cluster.nodes:
        client = redis.Redis(port=node.port)
        counts.append(client.dbsize())
        client.close()
    return counts


@pytest.mark.parametrize("piece_bytes", [512, 80 * 1024], ids=["pipelined", "concurrent"])
async def test_batches_cross_shards(cluster, piece_bytes):
    ns = namespace(tenant=f"cross-{piece_bytes}")
    backend = RedisBackend.from_spec(cluster.url, namespace=ns, pool=4)
    keys = page_keys(ns, 24)
    pages = Pages(24, piece_bytes).fill(seed=piece_bytes)
    assert await backend.set_from(keys, pages.buffers(range(24))) == 24
    assert all(count > 0 for count in _keys_per_node(cluster))  # every shard holds some
    assert await backend.exists(keys) == 24
    read = Pages(24, piece_bytes)
    assert await backend.get_into(keys, read.buffers(range(24))) == 24
    assert all(read.page_bytes(i) == pages.page_bytes(i) for i in range(24))
    await backend.delete(keys[10:11])
    assert await backend.exists(keys) == 10  # prefix count across shards
    await backend.clear()
    assert await backend.exists(keys[:1]) == 0
    assert sum(_keys_per_node(cluster)) == 0  # cleared on every primary
    await backend.aclose()


async def test_corrupt_value_on_a_shard(cluster):
    ns = namespace(tenant="corrupt")
    events: list[tuple[str, dict]] = []
    backend = RedisBackend.from_spec(
        cluster.url, namespace=ns, emit=lambda e, **f: events.append((e, f))
    )
    keys = page_keys(ns, 6)
    assert await backend.set_from(keys, Pages(6).fill(seed=5).buffers(range(6))) == 6
    owner = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    owner.set(keys[3], b"plain bytes written by another program")
    assert await backend.get_into(keys, Pages(6).buffers(range(6))) == 3
    assert events == [("storage.corrupt", {"key": keys[3], "reason": "magic", "backend": "redis"})]
    assert owner.exists(keys[3]) == 0
    owner.close()
    await backend.clear()
    await backend.aclose()


@pytest.mark.usefixtures("redis_installed")
async def test_lost_shard_is_misses_and_an_event_not_a_hang(tmp_path):
    # Its own cluster: this test breaks it.
    with RedisClusterServers(tmp_path / "lost") as lost:
        ns = namespace(tenant="lost")
        seen: list[str] = []
        backend = RedisBackend.from_spec(
            lost.url, namespace=ns, emit=lambda e, **f: seen.append(e), timeout=0.5
        )
        keys = page_keys(ns, 24)
        pages = Pages(24).fill(seed=6)
        assert await backend.set_from(keys, pages.buffers(range(24))) == 24
        lost.nodes[1].kill()
        with anyio.fail_after(30):
            present = await backend.exists(keys)
            hits = await backend.get_into(keys, Pages(24).buffers(range(24)))
        assert present < 24 and hits < 24
        assert seen.count("storage.unavailable") == 1
        await backend.aclose()
