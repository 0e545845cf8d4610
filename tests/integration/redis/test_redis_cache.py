"""The whole cache over Redis as L3 (production mode, asyncio; redis.asyncio runs on nothing
else): `hicache replay --storage redis://…` on a trace slice, a server killed and restarted
mid-replay, and two cache instances in two processes sharing one server or one cluster.

Every page that reaches L1 from L2 or L3 is checked byte for byte against the KV it must hold
(the replay's verification, or `bad_pages`), so a wrong value served would show as corrupt."""

from __future__ import annotations

import json

import anyio
import pytest
import redis

import hicache.cli.replay.command as replay_module
from hicache import HiCache
from hicache.cli.main import _REPO_TRACE
from hicache.cli.main import main as hicache_main
from hicache.cli.replay.command import replay
from hicache.cli.trace import read_trace
from hicache.config import CacheConfig
from hicache.observability import EventLog
from tests.integration.cache_writer_process import write_in_child
from tests.integration.storage_helpers import config, fetch, namespace_of, tokens_from

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

# A trace slice with reuse at distances beyond L1 and L2, so L3 serves part of it.
LIMIT, KV, BLOCK = 120, "mha:1:1:8:float16", 512
DEVICE, HOST = 65536, 131072
TOKENS = tokens_from(0, 64)  # 16 pages of 4 tokens, what the writer process caches
BOUND_S = 60  # hang guard on a whole replay or round trip, not a timing assertion


def replay_config(url: str) -> CacheConfig:
    return CacheConfig(
        kv=KV,
        page_size=64,
        device_tokens=DEVICE,
        host_tokens=HOST,
        storage=url,
        model_id="replay",
        write_policy="write_through",
        prefetch_policy="wait_complete",
    )


def test_replay_command_over_redis(server, tmp_path):
    out = tmp_path / "summary.json"
    rc = hicache_main([
        "replay", "--storage", server.url, "--limit", str(LIMIT), "--kv", KV,
        "--device-tokens", str(DEVICE), "--host-tokens", str(HOST), "--quiet", "--json", str(out),
    ])  # fmt: skip
    summary = json.loads(out.read_text())
    assert rc == 0 and summary["requests"] == LIMIT and summary["rejected_requests"] == 0
    assert summary["hit_tokens"]["storage"] > 0  # L3 served some prefixes ...
    assert summary["verified_pages"] > 0 and summary["corrupt_pages"] == 0  # ... all byte-exact
    stats = summary["storage_stats"]
    assert stats["get_hits"] > 0 and stats["corrupt"] == 0 and stats["errors"] == 0
    assert summary["bytes"]["s2h"] == stats["bytes_read"] > 0
    client = redis.Redis(port=server.port, socket_timeout=5)
    keys = client.keys("*")
    client.close()
    # Only pages, each under the cache's namespace (a page uploaded again overwrites its key).
    assert 0 < len(keys) <= stats["set_ok"]
    prefix = namespace_of(replay_config(server.url)).prefix.encode()
    assert all(key.startswith(prefix) for key in keys)


async def test_server_killed_and_restarted_mid_replay(server, monkeypatch):
    """Kill the server once L3 has served hits (its first come at request 61), start it again
    (empty: persistence is off) a little later. The replay runs on; the outage is two events; pages written after the
    restart are found by a fresh cache afterwards; nothing wrong reaches L1."""
    caches: list[HiCache] = []

    class Recorded(HiCache):  # lets the progress callback read the replay's backend counters
        async def __aenter__(self):
            caches.append(self)
            return await super().__aenter__()

    monkeypatch.setattr(replay_module, "HiCache", Recorded)
    limit, kill_at, restart_at = 150, 64, 80
    marks: dict[str, int] = {}

    def progress(done: int) -> None:
        hits = caches[0].backend.stats()["get_hits"]
        if "killed" not in marks and done >= kill_at:
            marks["killed"] = hits
            server.kill()
        elif "killed" in marks and "restarted" not in marks and done >= restart_at:
            server.start()
            marks["restarted"] = hits

    log = EventLog(capture=True)
    requests = read_trace(_REPO_TRACE, limit=limit, block_tokens=BLOCK)
    with anyio.fail_after(BOUND_S):
        tally, extra = await replay(
            replay_config(server.url),
            requests,
            block_tokens=BLOCK,
            batch=8,
            verify=True,
            log=log,
            progress=progress,
        )
    assert set(marks) == {"killed", "restarted"}
    assert tally.requests == limit and tally.rejected == 0
    assert tally.verified_pages > 0 and tally.corrupt_pages == 0
    names = [e["event"] for e in log.events if e["event"].startswith("storage.")]
    assert names.count("storage.unavailable") == 1 and names.count("storage.reconnected") == 1
    assert names.index("storage.unavailable") < names.index("storage.reconnected")
    assert "storage.corrupt" not in names
    backend = extra["backend"]
    assert backend["unavailable"] == 1 and backend["reconnected"] == 1 and backend["errors"] > 0
    assert marks["killed"] > 0  # and L3 had been serving before the outage too
    assert tally.storage_hit > 0
    # Writes resumed: the restarted server started empty, so whatever a fresh cache finds in it
    # was written after the restart. (Counting hits inside the replay would race the uploads:
    # whether a page lands before a later request asks for it is timing; the replay's close
    # drains every upload, so this count is not.)
    async with HiCache(replay_config(server.url)) as fresh:
        found = 0
        for i, req in enumerate(requests[restart_at:]):
            rid, tokens = f"after-{i}", req.tokens(BLOCK)
            await fresh.match(rid, tokens)
            await fresh.prefetch(rid, tokens)
            found += (await fresh.prefetch_wait(rid)).done_tokens
            await fresh.release(rid)
        corrupt = fresh.backend.stats()["corrupt"]
    assert found > 0 and corrupt == 0


# ---------------------------------------------------------------- two processes, one Redis


@pytest.fixture(params=["standalone", "cluster"])
def shared_url(request) -> str:
    """One server per test, or the module's three-master cluster (tests use their own tenants)."""
    if request.param == "standalone":
        return request.getfixturevalue("server").url
    return request.getfixturevalue("cluster").url


async def read_in_this_process(url: str, **overrides):
    """A fresh cache here (empty L1 and L2): fetch TOKENS from L3 into L1, every page checked."""
    cfg = config(storage=url, deterministic=False, prefetch_policy="wait_complete", **overrides)
    with anyio.fail_after(BOUND_S):
        async with HiCache(cfg) as cache:
            got = await fetch(cache, "reader", TOKENS)
            return got, await cache.stats()


async def test_second_process_cache_hits_what_the_first_wrote(shared_url, request):
    tenant = f"tenant-{request.node.callspec.id}"
    kv = config().kv
    wrote = write_in_child(shared_url, tenant=tenant, kv=kv, start=0, count=len(TOKENS))
    assert wrote["backend"]["set_ok"] == 16 and wrote["host_cached_tokens"] == 64

    got, stats = await read_in_this_process(shared_url, tenant=tenant)
    assert got.device_hit == 0  # nothing local ...
    assert got.prefetch.done_tokens == 64 and got.load.loaded_tokens == 64  # ... all from L3
    assert got.bad == 0  # byte-exact
    assert stats.storage_hit_tokens == 64

    # The same tokens under another tenant salt or another KV dtype share nothing.
    for other in (
        dict(tenant=tenant + "-other"),
        dict(tenant=tenant, kv=kv.replace("float32", "float16")),
    ):
        assert namespace_of(config(**other)).prefix != namespace_of(config(tenant=tenant)).prefix
        foreign, foreign_stats = await read_in_this_process(shared_url, **other)
        assert foreign.prefetch.hit_tokens == 0 and foreign.load.loaded_tokens == 0
        assert foreign_stats.storage_hit_tokens == 0


# ---------------------------------------------------------------- retention reaches Redis


async def test_a_retention_range_duration_becomes_the_values_expiry(server):
    """Pages cached under a range with a duration are uploaded with that expiry (Redis PX):
    their keys carry a TTL no longer than the range; pages without a range carry none."""
    from hicache import Retention
    from hicache.testing import ScriptedScheduler, synthetic_compute

    cfg = config(storage=server.url, deterministic=False, tenant="retention")
    prefix = namespace_of(cfg).prefix.encode()
    kept, plain = tokens_from(0, 16), tokens_from(5000, 16)
    with anyio.fail_after(BOUND_S):
        async with HiCache(cfg) as cache:
            for rid, tokens, ranges in (
                ("kept", kept, [Retention(0, None, priority=90, duration=600.0)]),
                ("plain", plain, []),
            ):
                await ScriptedScheduler(
                    cache,
                    compute=synthetic_compute(cache),
                    wait_prefetch=False,
                    retention_of=lambda _, r=ranges: r,
                ).run([[(rid, tokens)]])
            await cache.flush()
    client = redis.Redis(port=server.port, socket_timeout=5)
    ttls = sorted(client.pttl(key) for key in client.keys(prefix + b"*"))
    client.close()
    assert len(ttls) == 8  # four pages each
    assert ttls[:4] == [-1] * 4  # the plain request's: no expiry
    assert all(0 < ttl <= 600_000 for ttl in ttls[4:])  # the range's: at most its duration
