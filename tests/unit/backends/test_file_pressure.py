"""The file store at its cap and on a full filesystem: eviction from the index (no scan), a
rescan only where another writer shares the directory, "full" as one condition with a
backoff, and a cap the filesystem cannot hold lowered at open."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from hicache.backends.file import FileBackend
from hicache.backends.file import backend as file_backend
from hicache.backends.file.writers import WriterRegistry
from hicache.backends.fullness import FIRST_BACKOFF

from .conftest import FakeHostPool, page_keys
from .harness import Events

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def pool_of(n: int) -> FakeHostPool:
    pool = FakeHostPool(pages=n)
    for i in range(n):
        pool.fill(i, seed=i)
    return pool


async def write(backend, ns, first: int, n: int) -> tuple[list[str], int]:
    pool = pool_of(n)
    keys = page_keys(ns, n, start=first * ns.page_size)
    return keys, await backend.set_from(keys, [pool.page_buffer(i) for i in range(n)])


def one_value(tmp_path, ns) -> int:
    return FileBackend(tmp_path / "probe", namespace=ns)._on_disk(1)  # one block


async def test_eviction_at_the_cap_takes_the_index_victims_without_a_scan(
    tmp_path, ns, monkeypatch
):
    value = one_value(tmp_path, ns)
    backend = FileBackend(tmp_path / "s", namespace=ns, max_bytes=20 * value, threads=0)

    def no_scan(*args, **kw):
        raise AssertionError("a single writer's eviction scanned the directory")

    monkeypatch.setattr(file_backend, "scan", no_scan)
    for batch in range(10):  # 80 values into a cap of 20
        assert (await write(backend, ns, 100 * batch, 8))[1] == 8
    stats = backend.stats()
    assert stats["evictions"] >= 60 and stats["rescans"] == 0
    assert stats["stored_bytes"] <= 20 * value
    last, _ = await write(backend, ns, 5000, 2)
    assert await backend.exists(last) == 2


async def test_writers_on_one_directory_share_its_cap_and_rescan_only_then(tmp_path, ns):
    value = one_value(tmp_path, ns)
    cap = 40 * value
    a = FileBackend(tmp_path, namespace=ns, max_bytes=cap, threads=0)
    b = FileBackend(tmp_path, namespace=ns, max_bytes=cap, threads=0)
    assert a.stats()["writers"] == 1 and b.stats()["writers"] == 2  # a counts at its period
    for batch in range(8):  # 64 values each into a cap of 40: both evict
        await write(a, ns, 100 * batch, 8)
        await write(b, ns, 10_000 + 100 * batch, 8)
    assert a.stats()["writers"] == 2 and a.stats()["rescans"] >= 1
    for backend in (a, b):
        assert backend.stats()["share_bytes"] == cap // 2
        assert backend.stats()["stored_bytes"] <= cap // 2
    on_disk = sum(1 for _, _, files in os.walk(os.path.join(tmp_path, ns.digest)) for f in files)
    assert on_disk * value <= cap + 2 * value  # together within the cap (the lock files: 0 B)
    await b.aclose()
    for batch in range(8, 12):  # a's next period sees it alone: the whole cap is its again
        await write(a, ns, 100 * batch, 8)
    assert a.stats()["writers"] == 1 and a.stats()["share_bytes"] == cap
    alone = FileBackend(tmp_path / "alone", namespace=ns, max_bytes=cap, threads=0)
    for batch in range(8):
        await write(alone, ns, 100 * batch, 8)
    assert alone.stats()["rescans"] == 0  # nobody else there: nothing to learn
    await a.aclose()
    await alone.aclose()


async def test_a_dead_writers_values_are_adopted_by_the_next_rescan(tmp_path, ns):
    value = one_value(tmp_path, ns)
    cap = 40 * value
    survivor = FileBackend(tmp_path, namespace=ns, max_bytes=cap, threads=0)
    ghost = FileBackend(tmp_path, namespace=ns, max_bytes=cap, threads=0)
    await write(ghost, ns, 50_000, 16)
    os.close(ghost._writers._fd)  # its lock dies with its descriptor, as with SIGKILL
    ghost._writers._fd = None
    for batch in range(6):  # past the survivor's period: it finds the dead one, adopts
        await write(survivor, ns, 100 * batch, 8)
    stats = survivor.stats()
    assert stats["writers"] == 1 and stats["rescans"] >= 1
    assert stats["stored_bytes"] <= cap
    held = sum(1 for _, _, files in os.walk(os.path.join(tmp_path, ns.digest)) for _ in files)
    assert held * value <= cap + value  # the dead writer's values count against the cap again
    await survivor.aclose()


def test_a_dead_writers_lock_file_is_swept_and_a_live_one_counted(tmp_path):
    ns_dir = str(tmp_path)
    mine = WriterRegistry(ns_dir)
    other = WriterRegistry(ns_dir)  # another instance, alive
    assert mine.census()[0] == 1
    # a process that opened the directory and was killed: its lock died with it
    code = (
        "import os,sys; from hicache.backends.file.writers import WriterRegistry;"
        "kept = WriterRegistry(sys.argv[1]); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code, ns_dir], check=True)
    assert len(os.listdir(os.path.join(ns_dir, "writers"))) == 3
    assert mine.census()[0] == 1
    assert len(os.listdir(os.path.join(ns_dir, "writers"))) == 2  # the dead one's file is gone
    other.close()
    assert mine.census()[0] == 0
    mine.close()


async def test_a_full_filesystem_closes_writes_for_a_backoff_with_one_event(
    tmp_path, ns, monkeypatch
):
    clock = Clock()
    events = Events()
    backend = FileBackend(tmp_path, namespace=ns, threads=0, clock=clock, emit=events)
    real = file_backend.write_value
    space = [12]  # values the filesystem still takes

    def write_value(job):
        if space[0] <= 0:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), job[2])
        space[0] -= 1
        return real(job)

    monkeypatch.setattr(file_backend, "write_value", write_value)
    assert (await write(backend, ns, 0, 8))[1] == 8
    keys, stored = await write(backend, ns, 100, 8)  # 4 land, then the disk is full
    assert stored == 4
    assert not backend.accepts_writes()
    assert events.named("storage.full") and not events.named("storage.error")
    stats = backend.stats()
    assert stats["errors"] == 0 and stats["full"] == 1
    assert stats["max_bytes"] <= stats["stored_bytes"]  # the cap in force: what it could hold
    _, refused = await write(backend, ns, 200, 8)  # inside the backoff: no I/O at all
    assert refused == 0 and backend.stats()["refused_pages"] >= 8
    assert await backend.exists(keys[:4]) == 4  # reads go on
    space[0] = 100
    clock.now += FIRST_BACKOFF  # the backoff passed: writes resume
    assert backend.accepts_writes()
    assert (await write(backend, ns, 300, 2))[1] == 2
    assert events.named("storage.writes_resumed")


async def test_a_cap_the_filesystem_cannot_hold_is_lowered_at_open(tmp_path, ns, monkeypatch):
    events = Events()
    monkeypatch.setattr(file_backend, "default_cap", lambda directory, held, fraction: 1 << 20)
    backend = FileBackend(tmp_path, namespace=ns, max_bytes=1 << 30, emit=events)
    assert backend.max_bytes == 1 << 20 and backend.configured_max_bytes == 1 << 30
    (lowered,) = events.named("storage.cap_lowered")
    assert lowered["requested"] == 1 << 30 and lowered["effective"] == 1 << 20


def test_the_expiry_heap_stays_bounded_by_the_values_with_a_deadline():
    from hicache.backends.file.index import FileIndex

    index = FileIndex("lru")
    for rewrite in range(1000):  # the same 10 values, each written again with a new deadline
        index.wrote((f"h{i}", 4096, 1000.0 + rewrite) for i in range(10))
    assert index.deadline_rows() <= 2 * 10 + 64 + 1
    victims, expired = index.take_victims(now=10_000.0, limit=None)
    assert sorted(victims) == sorted(f"h{i}" for i in range(10)) and expired == 10
    assert index.deadline_rows() == 0 and len(index) == 0


async def test_a_store_alone_answers_probes_from_its_index(tmp_path, ns, monkeypatch):
    backend = FileBackend(tmp_path, namespace=ns, threads=0)
    keys, stored = await write(backend, ns, 0, 6)
    assert stored == 6

    def no_stat(*args, **kw):
        raise AssertionError("a store alone in its directory probed the filesystem")

    monkeypatch.setattr(file_backend, "_count_present", no_stat)
    assert await backend.exists(keys) == 6
    # A value removed behind the store's back: the probe still counts it, the read that
    # follows checks every value and stops there (a miss, never other bytes).
    os.unlink(backend._locate(keys[3:4])[1][0])
    assert await backend.exists(keys) == 6
    pool = FakeHostPool(pages=6)
    assert await backend.get_into(keys, [pool.page_buffer(i) for i in range(6)]) == 3
    assert await backend.exists(keys) == 3  # the read taught the index
    await backend.aclose()


async def test_a_shared_store_probes_the_files(tmp_path, ns):
    a = FileBackend(tmp_path, namespace=ns, threads=0)
    b = FileBackend(tmp_path, namespace=ns, threads=0)
    keys, _ = await write(a, ns, 0, 6)
    assert await b.exists(keys) == 6  # written by the other instance: found on disk
    os.unlink(a._locate(keys[2:3])[1][0])
    assert await a.exists(keys) == 2
    await a.aclose()
    await b.aclose()


@pytest.mark.parametrize("shared", [False, True])
async def test_a_key_whose_suffix_is_not_a_page_hash_is_refused_by_name(tmp_path, ns, shared):
    a = FileBackend(tmp_path, namespace=ns, threads=0)
    b = FileBackend(tmp_path, namespace=ns, threads=0) if shared else None
    keys, _ = await write(a, ns, 0, 3)
    bad = ns.prefix + "zz" * 32
    with pytest.raises(ValueError, match="zz"):
        await a.exists([keys[0], bad])
    with pytest.raises(ValueError, match=keys[1][-20:-1]):
        await a.exists([keys[0], keys[1][:-1]])
    assert await a.exists(keys) == 3  # nothing lost to the refused calls
    await a.aclose()
    if b is not None:
        await b.aclose()
