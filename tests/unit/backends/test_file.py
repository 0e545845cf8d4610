"""File-backend specifics; the shared contract is in test_contract.py."""

from __future__ import annotations

import os
import shutil

import pytest

from hicache.backends.file import FileBackend, value_path
from hicache.backends.file import io as file_mod
from hicache.backends.registry import open_backend

from .conftest import FakeHostPool, page_keys
from .harness import Events

pytestmark = pytest.mark.anyio


def tmp_files(root, ns):
    return os.listdir(os.path.join(root, ns.digest, "tmp"))


async def fill_and_store(backend, ns, n, start=0):
    pool = FakeHostPool(pages=n)
    for i in range(n):
        pool.fill(i, seed=start + i)
    keys = page_keys(ns, n, start=start * ns.page_size)
    assert await backend.set_from(keys, [pool.page_buffer(i) for i in range(n)]) == n
    return keys, pool


async def test_layout_is_sharded_by_hash(tmp_path, ns):
    backend = FileBackend(tmp_path, namespace=ns)
    keys, _ = await fill_and_store(backend, ns, 2)
    h = ns.page_hash_of(keys[0])
    path = value_path(tmp_path, ns.digest, h)
    assert path == os.path.join(tmp_path, ns.digest, h[:2], h[2:3], h) and os.path.isfile(path)
    assert tmp_files(tmp_path, ns) == []


async def test_crash_between_write_and_rename_leaves_only_a_temp_file(tmp_path, ns, monkeypatch):
    events = Events()
    backend = FileBackend(tmp_path, namespace=ns, emit=events, threads=0)
    keys, pool = await fill_and_store(backend, ns, 1)
    # A second page whose rename "crashes": simulate by making the unlink of the temp a no-op
    # and the rename fail, which is what a process dying after write() leaves behind.
    monkeypatch.setattr(
        file_mod.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError("crash"))
    )
    monkeypatch.setattr(file_mod, "_unlink_quietly", lambda p: None)
    more = page_keys(ns, 2)[1:]
    assert await backend.set_from(more, [pool.page_buffer(0)]) == 0
    assert [e["op"] for e in events.named("storage.error")] == ["set"]
    monkeypatch.undo()
    assert len(tmp_files(tmp_path, ns)) == 1  # the orphan, under tmp/ only
    assert await backend.exists(more) == 0  # never visible as a value
    out = FakeHostPool(pages=1)
    assert await backend.get_into(more, [out.page_buffer(0)]) == 0
    assert events.named("storage.corrupt") == []
    FileBackend(tmp_path, namespace=ns)  # a young temp may be another writer's: kept
    assert len(tmp_files(tmp_path, ns)) == 1
    FileBackend(tmp_path, namespace=ns, stale_temp_s=0)  # stale: cleaned at open
    assert tmp_files(tmp_path, ns) == []
    assert await backend.exists(keys) == 1


async def test_trailing_bytes_are_corrupt(tmp_path, ns):
    events = Events()
    backend = FileBackend(tmp_path, namespace=ns, emit=events)
    keys, _ = await fill_and_store(backend, ns, 1)
    with open(value_path(tmp_path, ns.digest, ns.page_hash_of(keys[0])), "ab") as f:
        f.write(b"extra")
    out = FakeHostPool(pages=1)
    assert await backend.get_into(keys, [out.page_buffer(0)]) == 0
    assert [e["reason"] for e in events.named("storage.corrupt")] == ["truncated"]


async def test_size_cap_evicts_oldest_and_takes_up_what_it_found_at_open(tmp_path, ns):
    probe = FileBackend(tmp_path / "probe", namespace=ns)
    await fill_and_store(probe, ns, 1)
    value_size = probe.stats()["stored_bytes"]  # one value as the store counts it: whole blocks
    other = FileBackend(tmp_path, namespace=ns)  # uncapped writer on the same directory
    old_keys, _ = await fill_and_store(other, ns, 4, start=0)
    for i, k in enumerate(old_keys):  # make them clearly oldest, in order
        os.utime(value_path(tmp_path, ns.digest, ns.page_hash_of(k)), ns=(10**9 * (i + 1),) * 2)
    await other.aclose()  # gone: what it wrote is the next instance's to hold
    capped = FileBackend(tmp_path, namespace=ns, max_bytes=6 * value_size)
    assert capped.stats()["stored_bytes"] > 0  # the open-time scan saw the 4 values
    new_keys, _ = await fill_and_store(capped, ns, 4, start=10)
    assert capped.stats()["stored_bytes"] <= 6 * value_size
    present = [await capped.exists([k]) for k in old_keys + new_keys]
    assert present[4:] == [1, 1, 1, 1]  # newest kept
    assert present[:4] == sorted(present[:4])  # evicted oldest first
    assert sum(present) <= 6
    assert capped.stats()["evictions"] == 8 - sum(present)


async def test_clear_leaves_other_namespace_dirs(tmp_path, ns):
    backend = FileBackend(tmp_path, namespace=ns)
    await fill_and_store(backend, ns, 3)
    foreign = tmp_path / "unrelated"
    foreign.mkdir()
    await backend.clear()
    assert sorted(os.listdir(tmp_path)) == sorted([ns.digest, "unrelated"])
    assert sorted(os.listdir(os.path.join(tmp_path, ns.digest))) == ["tmp", "writers"]
    keys, _ = await fill_and_store(backend, ns, 2)  # writes recreate shard dirs
    assert await backend.exists(keys) == 2


@pytest.mark.parametrize("threads, fsync", [(0, False), (3, True)])
async def test_inline_and_fsync_modes_round_trip(tmp_path, ns, threads, fsync):
    backend = FileBackend(tmp_path, namespace=ns, threads=threads, fsync=fsync)
    keys, pool = await fill_and_store(backend, ns, 5)
    out = FakeHostPool(pages=5)
    assert await backend.get_into(keys, [out.page_buffer(i) for i in range(5)]) == 5
    assert (out.data == pool.data).all()


async def test_many_pieces_beyond_iov_max(tmp_path, ns, monkeypatch):
    monkeypatch.setattr(file_mod, "_IOV_MAX", 3)  # forces split vector calls
    backend = FileBackend(tmp_path, namespace=ns, threads=0)
    pool = FakeHostPool(pages=1, layers=5, piece_bytes=7)
    pool.fill(0, seed=1)
    keys = page_keys(ns, 1)
    assert await backend.set_from(keys, [pool.page_buffer(0)]) == 1
    out = FakeHostPool(pages=1, layers=5, piece_bytes=7)
    assert await backend.get_into(keys, [out.page_buffer(0)]) == 1
    assert out.page_bytes(0) == pool.page_bytes(0)


def test_spec_and_option_errors(tmp_path, ns):
    b = open_backend(f"file:{tmp_path}", namespace=ns, fsync=True, max_bytes=1 << 20)
    assert isinstance(b, FileBackend) and b.fsync and b.max_bytes == 1 << 20
    with pytest.raises(TypeError, match="unknown file backend options"):
        open_backend(f"file:{tmp_path}", namespace=ns, cap=3)
    with pytest.raises(ValueError, match="max_bytes"):
        FileBackend(tmp_path, namespace=ns, max_bytes=0)
    with pytest.raises(ValueError, match="threads"):
        FileBackend(tmp_path, namespace=ns, threads=-1)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="cannot create directory"):
        FileBackend(tmp_path / "afile", namespace=ns)


async def test_unreadable_value_is_error_not_raise(tmp_path, ns):
    events = Events()
    backend = FileBackend(tmp_path, namespace=ns, emit=events, threads=0)
    keys, _ = await fill_and_store(backend, ns, 1)
    path = value_path(tmp_path, ns.digest, ns.page_hash_of(keys[0]))
    os.unlink(path)
    os.mkdir(path)  # a directory where a value should be: open() fails with an OSError
    out = FakeHostPool(pages=1)
    assert await backend.get_into(keys, [out.page_buffer(0)]) == 0
    assert [e["op"] for e in events.named("storage.error")] == ["get"]


# ---------------------------------------------------------------- a damaged directory


@pytest.mark.parametrize("removed", ["tmp", "namespace"])
async def test_deleted_directory_is_recreated_by_the_next_write(tmp_path, ns, removed):
    events = Events()
    backend = FileBackend(tmp_path, namespace=ns, emit=events, threads=0)
    await fill_and_store(backend, ns, 1)
    gone = os.path.join(tmp_path, ns.digest, *(["tmp"] if removed == "tmp" else []))
    shutil.rmtree(gone)  # someone cleaned up under a running cache
    keys, pool = await fill_and_store(backend, ns, 2, start=1)  # every page stored
    out = FakeHostPool(pages=2)
    assert await backend.get_into(keys, [out.page_buffer(i) for i in range(2)]) == 2
    assert [out.page_bytes(i) for i in range(2)] == [pool.page_bytes(i) for i in range(2)]
    assert events.named("storage.error") == [] and events.named("storage.writes_failing") == []
    assert tmp_files(tmp_path, ns) == []


def _block_writes(tmp_path, ns) -> str:
    """Put a plain file where the temporary directory was: every write then fails (even as
    root, which ignores permission bits) until the file is removed."""
    tmp = os.path.join(tmp_path, ns.digest, "tmp")
    shutil.rmtree(tmp)
    with open(tmp, "w"):
        pass
    return tmp


async def test_failing_writes_emit_one_event_per_streak(tmp_path, ns):
    events = Events()
    backend = FileBackend(tmp_path, namespace=ns, emit=events, threads=0, failure_streak=3)
    pool = FakeHostPool(pages=16)
    keys = page_keys(ns, 16)

    async def store(i: int, n: int = 1) -> int:
        return await backend.set_from(
            keys[i : i + n], [pool.page_buffer(j) for j in range(i, i + n)]
        )

    assert await store(0) == 1
    blocker = _block_writes(tmp_path, ns)
    assert await store(1) == 0 and await store(2) == 0
    assert events.named("storage.writes_failing") == []  # two failures: not yet a streak
    assert await store(3, 2) == 0  # the third and fourth
    (failing,) = events.named("storage.writes_failing")
    assert failing["failures"] == 3 and failing["directory"] == os.path.join(
        str(tmp_path), ns.digest
    )
    assert "NotADirectoryError" in failing["error"]
    assert await store(5, 3) == 0 and await store(8) == 0
    assert len(events.named("storage.writes_failing")) == 1  # once per streak, not per write
    assert len(events.named("storage.error")) == 8  # each failed write still has its own
    assert backend.stats()["write_failure_streaks"] == 1

    os.unlink(blocker)
    assert await store(9) == 1  # the directory comes back with the next write
    (recovered,) = events.named("storage.writes_recovered")
    assert recovered["failures"] == 8
    assert await store(10) == 1
    assert len(events.named("storage.writes_recovered")) == 1

    _block_writes(tmp_path, ns)
    assert await store(11, 3) == 0
    assert len(events.named("storage.writes_failing")) == 2  # a new streak, a new event
    assert backend.stats()["write_failure_streaks"] == 2


async def test_a_short_run_of_failures_is_no_streak(tmp_path, ns):
    events = Events()
    backend = FileBackend(tmp_path, namespace=ns, emit=events, threads=0, failure_streak=3)
    pool = FakeHostPool(pages=8)
    keys = page_keys(ns, 8)
    for round_ in range(3):  # two failures, then a success, three times over
        blocker = _block_writes(tmp_path, ns)
        for i in (0, 1):
            assert await backend.set_from(keys[i : i + 1], [pool.page_buffer(i)]) == 0
        os.unlink(blocker)
        assert await backend.set_from(keys[2 + round_ : 3 + round_], [pool.page_buffer(2)]) == 1
    assert (
        events.named("storage.writes_failing") == []
        and events.named("storage.writes_recovered") == []
    )


def test_failure_streak_option_is_checked(tmp_path, ns):
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="failure_streak"):
            FileBackend(tmp_path, namespace=ns, failure_streak=bad)
    assert open_backend(f"file:{tmp_path}", namespace=ns, failure_streak=2) is not None
