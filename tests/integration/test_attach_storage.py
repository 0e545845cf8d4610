"""Attach and detach L3 on a running cache (`HiCache.attach_storage` / `detach_storage`), on
virtual time: a detach while uploads and prefetches are in flight (they drain, or end as
failures and misses; no request fails and every page that reaches L1 holds its KV), attaching
a store to a cache built without one, swapping stores, bad specs that change nothing, and a
replay that detaches halfway and attaches again."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hicache import CacheConfig, HiCache
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.cli.checklog import check_events
from hicache.cli.main import main
from hicache.cli.replay.command import replay
from hicache.cli.trace import read_trace
from hicache.config import ConfigError
from hicache.observability import EventLog
from hicache.results import InvalidRequest
from hicache.testing import run_virtual, virtual_config
from tests.integration.storage_helpers import (
    PAGE,
    compute_into,
    config,
    fetch,
    slow_memory,
    tokens_from,
    write,
)

LATENCY = 0.125  # virtual seconds per storage call of the slow reader
BATCH = 4  # pages per probe and read batch
A = tokens_from(0, 64)  # 16 pages, in the store before the test
B = tokens_from(5000, 32)  # 8 pages, cached during the test
C = tokens_from(9000, 32)
SPEC = "tests.integration.test_attach_storage:TrackedMemory?password=hunter2"
TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_trace_400.jsonl"


class TrackedMemory(MemoryBackend):
    """A memory backend opened by spec (`module:Class?...`) that records its close in the
    list given as option `closed` (the registry imports this module under its own name)."""

    @classmethod
    def from_spec(cls, spec, *, namespace, emit=None, closed, **options):  # type: ignore[override]
        backend = cls(namespace=namespace, emit=emit, **options)
        backend.closed = closed
        return backend

    async def aclose(self) -> None:
        self.closed.append(id(self))
        await super().aclose()


def storage_events(log: EventLog) -> list[dict]:
    return [e for e in log.events if e["event"] in ("storage.attached", "storage.detached")]


def empty_tables(cache: HiCache) -> None:
    assert cache.close_tables is not None and "storage_calls" in cache.close_tables
    assert not {k: n for k, n in cache.close_tables.items() if n}
    assert cache.close_report is not None
    assert all(v["used"] == 0 for v in cache.close_report.values())


async def stored(*sequences: np.ndarray) -> MemoryStore:
    """A store holding every page of `sequences`, written by a cache with storage."""
    store = MemoryStore()
    async with HiCache(config(storage="memory", extra={"store": store})) as writer:
        for i, tokens in enumerate(sequences):
            await write(writer, f"w{i}", tokens)
    assert len(store) == sum(len(t) // PAGE for t in sequences)
    return store


async def cache_request(cache: HiCache, rid: str, tokens: np.ndarray) -> None:
    """One request computed and cached as finished (no wait for its backup or upload)."""
    m = await cache.match(rid, tokens)
    assert m.device_len == 0
    slots = await cache.allocate(rid, len(tokens))
    compute_into(cache)(rid, tokens, np.asarray(slots), 0)
    await cache.cache_finished(rid, tokens, slots)


# ---------------------------------------------------------------- detach under load


@pytest.mark.parametrize("upload", ["slow", "hung"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_detach_drains_uploads_and_prefetches_while_requests_go_on(upload, seed):
    """The detach turns new storage work off at once and returns only once the upload and the
    prefetch in flight have ended: the upload stores (slow) or fails at its deadline (hung),
    the prefetch settles with the pages already read, verified. Requests run meanwhile."""
    slow = upload == "slow"
    faults = {"delays": {("set_from", 0): 3.0}} if slow else {"hang_sets": {0}}
    log = EventLog(capture=True)

    async def main():
        store = await stored(A)
        cfg = config(
            storage_batch_pages=BATCH,
            prefetch_policy="wait_complete",
            storage_timeout=10.0 if slow else 2.0,
        )
        backend = slow_memory(cfg, store, latency=LATENCY, **faults)
        async with HiCache(cfg, backend=backend, log=log) as cache:
            await cache_request(cache, "b", B)  # its backup, then its upload (3 s or hung)
            await cache.match("a", A)
            started = await cache.prefetch("a", A)
            await cache.system.sleep(4 * LATENCY + 1.5 * LATENCY)  # probed, one batch read
            inflight = (await cache.stats()).inflight
            calls = dict(backend.calls)
            asked = cache.system.now()
            mark = len(log.events)

            done = cache.system.reply()

            async def detacher():
                out = await cache.detach_storage()
                done.set((out, cache.system.now()))

            cache.system.start_soon(detacher, name="detacher")
            # Requests go on while the detach waits: "a" gets what had arrived, verified.
            got = await fetch(cache, "a", A)
            await cache.match("c", C)
            late = await cache.prefetch("c", C)  # storage is off for it
            await cache.release("c")
            await cache_request(cache, "c2", C)  # cached while detaching: never uploaded
            request_done = cache.system.now()
            detached, detached_at = await done.wait()
            after = dict(
                backend=cache.backend,
                cleared=await cache.clear_storage(),
                prefetch=await fetch(cache, "a2", A),
            )
            await cache.flush()
            return (
                started, inflight, calls, dict(backend.calls), asked, mark, got, late,
                request_done, detached, detached_at, after, len(store), cache,
            )  # fmt: skip

    (
        started, inflight, calls, calls_after, asked, mark, got, late,
        request_done, detached, detached_at, after, stored_pages, cache,
    ) = run_virtual(main, seed=seed)  # fmt: skip

    assert started.state == "running"
    assert inflight["uploads"] == 1 and inflight["prefetches"] == 1
    assert detached is True
    # The prefetch ended with what had arrived (a whole batch, verified), never wrong KV.
    assert got.prefetch.state == "done" and 0 < got.prefetch.done_tokens < len(A)
    assert got.load.loaded_tokens == got.prefetch.done_tokens and got.bad == 0
    # New work saw no storage from the detach on; requests did not wait for it.
    assert late.state == "none"
    assert calls_after == calls  # no storage call started after the detach was asked
    assert request_done < detached_at
    if upload == "slow":
        assert detached_at >= 3.0 and stored_pages == len(A) // PAGE + len(B) // PAGE
    else:  # failed at its deadline: the pages are later misses
        assert detached_at - asked <= 2.0 + LATENCY and stored_pages == len(A) // PAGE
    assert after["backend"] is None and after["cleared"] is False
    assert after["prefetch"].prefetch.state == "none" and after["prefetch"].bad == 0

    events = log.events[mark:]
    names = [e["event"] for e in events]
    assert "tree.prefetch_started" not in names  # nothing started after the detach
    detaches = [e for e in events if e["event"] == "storage.detached"]
    assert len(detaches) == 1 and not [e for e in log.events if e["event"] == "storage.attached"]
    d = detaches[0]
    assert d["uploads"] == 1 and d["prefetches"] == 1 and d["owned"] is False
    assert d["spec"].endswith(":FaultyBackend") and d["component"] == "cache"
    end = "uploader.stored" if upload == "slow" else "uploader.failed"
    assert names.index(end) < names.index("storage.detached")
    assert names.index("prefetcher.done") < names.index("storage.detached")
    empty_tables(cache)
    check_events(log.events)  # slot ownership, op ends, the close: re-derived from the log


def test_detach_drops_the_upload_backlog_and_counts_it():
    """Uploads waiting for a credit when the detach comes are not uploaded (skipped)."""
    log = EventLog(capture=True)

    async def main():
        store = MemoryStore()
        cfg = config(channel_capacity=8)  # one upload credit
        backend = slow_memory(cfg, store, latency=1.0)
        async with HiCache(cfg, backend=backend, log=log) as cache:
            for k in range(4):
                await cache_request(cache, f"w{k}", tokens_from(1000 * k, 16))
            await cache.system.sleep(0.01)  # backups landed: one upload, the rest queued
            assert await cache.detach_storage()
            await cache.flush()
            return len(store), cache

    pages, cache = run_virtual(main)
    (d,) = [e for e in log.events if e["event"] == "storage.detached"]
    assert d["uploads"] == 1 and d["skipped_uploads"] == 3
    assert pages == 4  # the one upload in flight stored its four pages
    empty_tables(cache)


# ---------------------------------------------------------------- attach


def test_attach_to_a_cache_built_without_storage():
    log = EventLog(capture=True)

    async def main():
        store = await stored(A)
        async with HiCache(config(prefetch_policy="wait_complete"), log=log) as cache:
            assert cache.backend is None
            before = await fetch(cache, "r0", A)
            cleared = await cache.clear_storage()
            await cache.attach_storage("memory", store=store)
            backend = cache.backend
            got = await fetch(cache, "r1", A)
            await write(cache, "w", B)  # uploaded to the attached store
            with pytest.raises(InvalidRequest, match="attached already"):
                await cache.attach_storage("memory", store=MemoryStore())
            same = cache.backend is backend
            stats = await cache.stats()
            return before, cleared, backend, got, len(store), same, stats, cache

    before, cleared, backend, got, pages, same, stats, cache = run_virtual(main)
    assert before.prefetch.state == "none" and before.load.loaded_tokens == 0
    assert cleared is False
    assert backend is not None and same
    assert got.prefetch.state == "done" and got.prefetch.done_tokens == len(A)
    assert got.load.loaded_tokens == len(A) and got.bad == 0
    assert stats.storage_hit_tokens == len(A)
    assert pages == (len(A) + len(B)) // PAGE
    (attached,) = storage_events(log)
    assert attached["event"] == "storage.attached"
    assert attached["spec"] == "memory" and attached["owned"] is True
    empty_tables(cache)


def test_detach_then_attach_another_store_and_back():
    """Each store gets what was written while it was attached; what the cache opened it
    closes, once, on detach or at close; the spec's password never reaches an event."""
    log = EventLog(capture=True)
    closed_backends: list[int] = []  # ids of the backends closed, in order

    async def main():
        first, second = MemoryStore(), MemoryStore()
        async with HiCache(config(prefetch_policy="wait_complete"), log=log) as cache:
            await cache.attach_storage(SPEC, store=first, closed=closed_backends)
            one = id(cache.backend)
            await write(cache, "a", A)  # into the first store
            assert await cache.detach_storage() is True
            closed_on_detach = list(closed_backends)
            assert await cache.detach_storage() is False  # nothing attached any more
            await cache.attach_storage(SPEC, store=second, closed=closed_backends)
            two = id(cache.backend)
            await cache.clear(("device", "host"))
            miss = await fetch(cache, "r1", A)  # the second store never had A
            await write(cache, "b", B)  # into the second store only
            await cache.detach_storage()
            await cache.attach_storage(SPEC, store=first, closed=closed_backends)
            three = id(cache.backend)
            await cache.clear(("device", "host"))
            hit = await fetch(cache, "r2", A)
            counts = len(first), len(second)
        return one, two, three, closed_on_detach, miss, hit, counts, cache

    one, two, three, closed_on_detach, miss, hit, counts, cache = run_virtual(main)
    assert closed_on_detach == [one]
    assert closed_backends == [one, two, three]  # the last one at close
    assert miss.prefetch.done_tokens == 0 and miss.bad == 0
    assert hit.prefetch.done_tokens == len(A) and hit.load.loaded_tokens == len(A)
    assert hit.bad == 0
    assert counts == (len(A) // PAGE, len(B) // PAGE)
    events = storage_events(log)
    assert [e["event"] for e in events] == [
        "storage.attached",
        "storage.detached",
        "storage.attached",
        "storage.detached",
        "storage.attached",
    ]
    assert {e["spec"] for e in events} == {SPEC.replace("hunter2", "***")}
    assert "hunter2" not in json.dumps(log.events, default=str)
    empty_tables(cache)


# ---------------------------------------------------------------- what must change nothing


def test_a_bad_spec_raises_naming_it_and_changes_nothing():
    log = EventLog(capture=True)

    async def main():
        store = await stored(A)
        errors = []
        async with HiCache(config(prefetch_policy="wait_complete"), log=log) as cache:
            for spec, error in (
                ("nosuch", ValueError),
                ("file:", ValueError),
                ("no_such_module.sub:Backend?password=hunter2", ImportError),
            ):
                with pytest.raises(error) as caught:
                    await cache.attach_storage(spec)
                errors.append(str(caught.value))
            with pytest.raises(TypeError, match="bogus"):
                await cache.attach_storage("memory", bogus=1)
            with pytest.raises(TypeError, match="spec string or a StorageBackend"):
                await cache.attach_storage(42)  # type: ignore[arg-type]
            off = cache.backend, await fetch(cache, "r0", A), await cache.clear_storage()
            # With storage attached, a bad spec leaves it attached and working.
            await cache.attach_storage("memory", store=store)
            backend = cache.backend
            with pytest.raises(ValueError, match="nosuch"):
                await cache.attach_storage("nosuch")
            on = cache.backend is backend, await fetch(cache, "r1", A)
        return errors, off, on, cache

    errors, off, on, cache = run_virtual(main)
    assert "'nosuch'" in errors[0] and "known forms" in errors[0]
    assert "file:" in errors[1]
    assert "no_such_module.sub:Backend?password=***" in errors[2] and "hunter2" not in errors[2]
    backend, before, cleared = off
    assert backend is None and before.prefetch.state == "none" and cleared is False
    same, got = on
    assert same and got.prefetch.done_tokens == len(A) and got.bad == 0
    assert [e["event"] for e in storage_events(log)] == ["storage.attached"]
    empty_tables(cache)


def test_attach_needs_a_model_id_and_one_rank():
    async def main():
        async with HiCache(virtual_config()) as cache:  # the default model_id
            with pytest.raises(ConfigError, match="model_id"):
                await cache.attach_storage("memory")
            return cache.backend

    assert run_virtual(main) is None
    tp = HiCache(config(tp_size=2, tp_rank=0))  # refused before anything opens

    async def attach():
        await tp.attach_storage("memory")

    async def detach():
        await tp.detach_storage()

    for call in (attach, detach):
        with pytest.raises(ConfigError, match="tp_size=2"):
            run_virtual(call)


# ---------------------------------------------------------------- the replay


def test_a_replay_detaches_halfway_and_recovers_after_attaching_again():
    store = MemoryStore()
    cfg = CacheConfig(
        kv="mha:1:1:8:float16",
        page_size=64,
        device_tokens=65536,
        host_tokens=131072,
        storage="memory",
        extra={"store": store},
        model_id="replay-attach",
        prefetch_policy="wait_complete",
        write_policy="write_through",
        deterministic=True,
    )
    requests = read_trace(TRACE, limit=160, block_tokens=512)
    log = EventLog(capture=True)

    async def main():
        return await replay(
            cfg,
            requests,
            block_tokens=512,
            batch=8,
            verify=True,
            log=log,
            progress=lambda done: None,
            detach_at=64,
            attach_at=100,
        )

    tally, extra = run_virtual(main)
    assert tally.requests == 160 and tally.corrupt_pages == 0 and tally.verified_pages > 0
    names = [e["event"] for e in log.events]
    assert names.count("storage.detached") == 1 and names.count("storage.attached") == 1
    detached = names.index("storage.detached")
    attached = names.index("storage.attached")
    assert detached < attached

    def storage_hits(lo: int, hi: int) -> int:
        return sum(
            e.get("read", 0) for e in log.events[lo:hi] if e["event"] == "tree.prefetch_done"
        )

    assert storage_hits(0, detached) > 0
    assert storage_hits(detached, attached) == 0  # no L3 while detached
    assert "tree.prefetch_started" not in names[detached:attached]
    assert storage_hits(attached, len(names)) > 0  # L3 hits again after the attach
    (closed,) = [e for e in log.events if e["event"] == "cache.closed"]
    assert closed["tables_left"] == {} and not any(closed["used"].values())
    assert extra["backend"]["bytes_read"] > 0  # the re-attached backend's own counters
    check_events(log.events, device_tokens=cfg.device_tokens)


def test_the_replay_command_takes_detach_at_and_attach_at(tmp_path, capsys):
    summary = tmp_path / "summary.json"
    small = ["replay", "--trace", str(TRACE), "--limit", "60", "--kv", "mha:1:1:8:float16"]
    small += ["--device-tokens", "65536", "--host-tokens", "131072", "--quiet"]
    switches = ["--detach-at", "20", "--attach-at", "40"]
    assert (
        main([*small, "--storage", "memory", "--deterministic", *switches, "--json", str(summary)])
        == 0
    )
    s = json.loads(summary.read_text())
    assert s["requests"] == 60 and s["corrupt_pages"] == 0 and s["verified_pages"] > 0
    assert s["config"]["detach_at"] == 20 and s["config"]["attach_at"] == 40
    capsys.readouterr()
    assert main([*small, "--storage", "memory", "--attach-at", "40"]) == 2
    assert "--attach-at needs --detach-at" in capsys.readouterr().err
    assert main([*small, "--storage", "none", "--detach-at", "20"]) == 2
    assert "--detach-at needs storage" in capsys.readouterr().err
