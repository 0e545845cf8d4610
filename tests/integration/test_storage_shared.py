"""L3 shared between cache instances, on virtual time: a file store the next instance reads,
namespaces and tenant salts that keep others' pages apart, damaged values that are misses
and never KV, TP ranks, failing and missing storage, and clear_storage."""

from __future__ import annotations

import os

import pytest

from hicache import HiCache
from hicache.backends.file import value_path
from hicache.backends.memory import MemoryStore
from hicache.observability import EventLog
from hicache.radix.hashes import chain_page_hashes
from hicache.testing import ScriptedScheduler, run_virtual
from tests.integration.storage_helpers import (
    PAGE,
    compute_into,
    config,
    fetch,
    namespace_of,
    slow_memory,
    tokens_from,
    write,
)

TOKENS = tokens_from(0, 64)  # 16 pages
HASHES = chain_page_hashes(TOKENS, PAGE)


def file_config(root, **overrides):
    return config(storage=f"file:{root}", prefetch_policy="wait_complete", **overrides)


async def read_in_new_instance(cfg, tokens=TOKENS, log=None):
    """Open a fresh cache (empty L1 and L2) and fetch `tokens` from L3 into L1, verified."""
    async with HiCache(cfg, log=log) as cache:
        got = await fetch(cache, "reader", tokens)
        return got, await cache.stats()


def value_files(root) -> list[str]:
    """Every stored value under a file store, temporary files excluded."""
    out = []
    for path, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "tmp"]
        out += [os.path.join(path, f) for f in files]
    return sorted(out)


# ---------------------------------------------------------------- sharing one file store


def test_second_instance_hits_what_the_first_wrote(tmp_path):
    cfg = file_config(tmp_path)

    async def main():
        async with HiCache(cfg) as first:
            await write(first, "w", TOKENS)
        return await read_in_new_instance(cfg)

    got, stats = run_virtual(main)
    assert len(value_files(tmp_path)) == 16
    assert got.device_hit == 0  # nothing in the new instance's L1 or L2 ...
    assert got.prefetch.done_tokens == 64 and got.load.loaded_tokens == 64  # ... all from L3
    assert got.bad == 0
    assert stats.storage_hit_tokens == 64


def test_two_open_instances_share_pages_as_they_are_written(tmp_path):
    cfg = file_config(tmp_path)

    async def main():
        async with HiCache(cfg) as a, HiCache(cfg) as b:
            await write(a, "w", TOKENS[:32])
            first = await fetch(b, "r1", TOKENS)
            await write(a, "w2", TOKENS)
            # b now holds the first 32 tokens itself; the rest comes from a's later write.
            second = await fetch(b, "r2", TOKENS)
            return first, second

    first, second = run_virtual(main)
    assert first.prefetch.done_tokens == 32 and first.bad == 0
    assert second.device_hit == 32 and second.prefetch.done_tokens == 32
    assert len(second.load.device_slots) == 64 and second.bad == 0


@pytest.mark.parametrize(
    "other",
    [
        dict(model_id="other-model"),
        dict(kv="mha:2:1:8:float16"),  # another kv dtype
        dict(kv="mha:2:2:8:float32"),  # another geometry
        dict(page_size=8),
        dict(layout="layer_first"),
        dict(tenant="another-tenant"),
    ],
)
def test_another_namespace_or_tenant_misses(tmp_path, other):
    async def main():
        async with HiCache(file_config(tmp_path)) as writer:
            await write(writer, "w", TOKENS)
        same = await read_in_new_instance(file_config(tmp_path))
        foreign = await read_in_new_instance(file_config(tmp_path, **other))
        return same, foreign

    (same, _), (foreign, stats) = run_virtual(main)
    assert same.prefetch.done_tokens == 64  # the control: the writer's namespace hits
    assert foreign.prefetch.state == "revoked" and foreign.prefetch.hit_tokens == 0
    assert foreign.load.loaded_tokens == 0 and stats.storage_hit_tokens == 0
    assert (
        namespace_of(file_config(tmp_path, **other)).prefix
        != namespace_of(file_config(tmp_path)).prefix
    )


# ---------------------------------------------------------------- damaged values


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 7)


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("flip", "checksum"),
        ("truncate", "truncated"),
        ("swap", "key"),
    ],
)
def test_damaged_value_is_a_miss_an_event_and_deleted(tmp_path, damage, reason):
    log = EventLog(capture=True)
    cfg = file_config(tmp_path)
    bad_page, other_page = 5, 9
    digest = namespace_of(cfg).digest

    def path(page: int) -> str:
        return value_path(tmp_path, digest, HASHES[page])

    async def main():
        async with HiCache(cfg) as writer:
            await write(writer, "w", TOKENS)
        assert all(os.path.exists(path(p)) for p in range(16))
        if damage == "flip":
            _flip(path(bad_page))
        elif damage == "truncate":
            _truncate(path(bad_page))
        else:  # each file now holds the other page's value, under the wrong name
            a, b = path(bad_page), path(other_page)
            os.rename(a, a + ".x")
            os.rename(b, a)
            os.rename(a + ".x", b)
        return await read_in_new_instance(cfg, log=log)

    got, stats = run_virtual(main)
    # The pages before the damaged one arrive; it and all after it are misses.
    assert got.prefetch.hit_tokens == 64  # present, as far as a probe can tell
    assert got.prefetch.done_tokens == bad_page * PAGE
    assert got.load.loaded_tokens == bad_page * PAGE and got.bad == 0
    assert stats.storage_hit_tokens == bad_page * PAGE
    corrupt = [e for e in log.events if e["event"] == "storage.corrupt"]
    ns = namespace_of(cfg)
    assert ns.key(HASHES[bad_page]) in {e["key"] for e in corrupt}
    assert {e["reason"] for e in corrupt} == {reason}
    assert not os.path.exists(path(bad_page))
    assert os.path.exists(path(bad_page - 1))


# ---------------------------------------------------------------- tensor-parallel ranks


@pytest.fixture
def one_process_group():
    """A one-member gloo group, so a cache with tp_size > 1 may open (it refuses without a
    process group). Each rank's cache runs alone here, in step with itself; ranks agreeing
    across processes are tests/integration/test_tp_agreement.py's."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_process_group")
def test_mha_ranks_keep_their_own_keys(tmp_path):
    rank0 = file_config(tmp_path, tp_size=2, tp_rank=0)
    rank1 = file_config(tmp_path, tp_size=2, tp_rank=1)

    async def main():
        async with HiCache(rank0) as writer:
            await write(writer, "w", TOKENS)
        other = await read_in_new_instance(rank1)
        own = await read_in_new_instance(rank0)
        async with HiCache(rank1) as writer:
            await write(writer, "w", TOKENS)
        return other, own

    (other, _), (own, _) = run_virtual(main)
    assert namespace_of(rank0).prefix != namespace_of(rank1).prefix
    assert other.prefetch.hit_tokens == 0 and own.prefetch.done_tokens == 64
    assert len(value_files(tmp_path)) == 2 * 16  # each rank wrote its own shard's pages
    assert {os.path.relpath(p, tmp_path).split(os.sep)[0] for p in value_files(tmp_path)} == {
        namespace_of(rank0).digest,
        namespace_of(rank1).digest,
    }


@pytest.mark.usefixtures("one_process_group")
def test_mla_only_rank_zero_uploads_and_every_rank_reads_it(tmp_path):
    log = EventLog(capture=True)
    kv = "mla:2:8:4:float32"
    rank0 = file_config(tmp_path, kv=kv, tp_size=2, tp_rank=0)
    rank1 = file_config(tmp_path, kv=kv, tp_size=2, tp_rank=1)

    async def main():
        async with HiCache(rank1, log=log) as writer:
            await write(writer, "w", TOKENS)
            backed_up = (await writer.stats()).host.cached_tokens
        files_after_rank1 = len(value_files(tmp_path))
        async with HiCache(rank0) as writer:
            await write(writer, "w", TOKENS)
        got = await read_in_new_instance(rank1)
        return backed_up, files_after_rank1, got

    backed_up, files_after_rank1, (got, stats) = run_virtual(main)
    assert namespace_of(rank0).prefix == namespace_of(rank1).prefix
    assert backed_up == 64  # rank 1 did write its L2 ...
    assert files_after_rank1 == 0  # ... but nothing to L3
    assert not [e for e in log.events if e["event"].startswith("uploader.")]
    assert len(value_files(tmp_path)) == 16
    assert got.prefetch.done_tokens == 64 and got.bad == 0 and stats.storage_hit_tokens == 64


# ---------------------------------------------------------------- failing storage


def test_upload_retries_with_backoff_then_gives_up_without_failing_the_request():
    log = EventLog(capture=True)
    store = MemoryStore()
    cfg = config(upload_retries=3, upload_backoff=0.05)

    async def main():
        backend = slow_memory(cfg, store, fail_sets={0, 1, 2, 3})  # every try of the first upload
        async with HiCache(cfg, backend=backend, log=log) as cache:
            sched = ScriptedScheduler(cache, compute=compute_into(cache))
            records = await sched.run([[("a", TOKENS)]])
            await cache.flush()
            await write(cache, "b", tokens_from(500, 32))  # the next upload goes through
            tries = backend.calls["set_from"]
        return records, tries

    records, tries = run_virtual(main)
    assert records[0].computed == 64
    assert tries == 5
    retries = [e for e in log.events if e["event"] == "uploader.retry"]
    assert [e["delay"] for e in retries] == [0.05, 0.1, 0.2]
    assert [e["attempt"] for e in retries] == [1, 2, 3]
    failed = [e for e in log.events if e["event"] == "uploader.failed"]
    assert len(failed) == 1 and failed[0]["stored"] == 0 and failed[0]["pages"] == 16
    # Each try starts one backoff after the previous one failed (no latency: failures are
    # instant), so the give-up comes 0.05 + 0.1 + 0.2 after the first failure.
    assert failed[0]["t"] - retries[0]["t"] == pytest.approx(0.05 + 0.1 + 0.2, abs=1e-6)
    assert len(store) == 8  # only the second request's pages; the first's are a later miss


def test_upload_that_fails_once_is_stored_by_the_retry():
    store = MemoryStore()
    cfg = config(prefetch_policy="wait_complete")

    async def main():
        async with HiCache(cfg, backend=slow_memory(cfg, store, fail_sets={0})) as cache:
            await write(cache, "a", TOKENS)
        async with HiCache(cfg, backend=slow_memory(cfg, store)) as cache:
            return await fetch(cache, "r", TOKENS)

    got = run_virtual(main)
    assert len(store) == 16
    assert got.prefetch.done_tokens == 64 and got.bad == 0


def test_storage_down_is_misses_only():
    log = EventLog(capture=True)
    store = MemoryStore()
    cfg = config(prefetch_policy="wait_complete", upload_retries=1)

    async def main():
        async with HiCache(cfg, backend=slow_memory(cfg, store)) as cache:
            await write(cache, "w", TOKENS)  # in L3 before the outage
        async with HiCache(cfg, backend=slow_memory(cfg, store, down=True), log=log) as cache:
            sched = ScriptedScheduler(cache, compute=compute_into(cache))
            records = await sched.run([[("a", TOKENS)], [("b", tokens_from(500, 32))]])
            await cache.flush()
            again = await fetch(cache, "again", TOKENS)  # L1 and L2 still serve it
            return records, again, await cache.stats()

    records, again, stats = run_virtual(main)
    assert [r.prefetch_state for r in records] == ["revoked", "revoked"]
    assert [r.computed for r in records] == [64, 32]
    assert len(again.load.device_slots) == 64 and again.prefetch.state == "skipped"
    assert again.bad == 0
    assert stats.storage_hit_tokens == 0
    assert len([e for e in log.events if e["event"] == "uploader.failed"]) == 2
    assert len(store) == 16  # nothing lost, nothing added


# ---------------------------------------------------------------- clear_storage


@pytest.mark.parametrize("kind", ["file", "memory"])
def test_clear_storage_removes_this_namespace_only(tmp_path, kind):
    store = MemoryStore()

    def cfg(tenant):
        if kind == "file":
            return file_config(tmp_path, tenant=tenant)
        return config(
            storage="memory", extra={"store": store}, tenant=tenant, prefetch_policy="wait_complete"
        )

    async def main():
        async with HiCache(cfg("a")) as a, HiCache(cfg("b")) as b:
            await write(a, "w", TOKENS)
            await write(b, "w", TOKENS)
            cleared = await a.clear_storage()
        return cleared, await read_in_new_instance(cfg("a")), await read_in_new_instance(cfg("b"))

    cleared, (in_a, _), (in_b, _) = run_virtual(main)
    assert cleared is True
    assert in_a.prefetch.hit_tokens == 0
    assert in_b.prefetch.done_tokens == 64 and in_b.bad == 0
    if kind == "file":
        left = {os.path.relpath(p, tmp_path).split(os.sep)[0] for p in value_files(tmp_path)}
        assert left == {namespace_of(cfg("b")).digest}
        assert len(value_files(tmp_path)) == 16
    else:
        assert len(store) == 16
        assert all(k.startswith(namespace_of(cfg("b")).prefix) for k in store.scan("hicache:"))
