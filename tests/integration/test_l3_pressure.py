"""A store at its cap, full, or hung: pressure on L3 costs hits, never the cache calls' pace.

Every test runs on virtual time: a call that waited on an upload would let the clock jump to
the storage deadline, so "no call waited" is "the clock never got near it". The cache's own
answers (KV verified by the scheduler) and the count of what was dropped are checked too."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from hicache import HiCache
from hicache.backends.file import FileBackend
from hicache.backends.file import backend as file_backend
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.observability import EventLog
from hicache.testing import ScriptedScheduler, run_virtual, synthetic_compute
from tests.integration.storage_helpers import config as storage_config
from tests.integration.storage_helpers import namespace_of

DEADLINE = 1000.0  # storage_timeout: far beyond anything the calls themselves take


def tokens(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


class HungWrites(MemoryBackend):
    """A memory store whose writes never return (until the cache's deadline cancels them)."""

    async def set_from(self, keys, sources):
        import anyio

        await anyio.sleep_forever()
        raise AssertionError("unreachable")


def run_requests(backend_of, *, log: EventLog, requests: int = 24, **cfg_over):
    """Write-back and a small L2: every L1 eviction needs an L2 copy, and uploads hold L2
    pages while they run. Returns (virtual seconds the calls took, the
    tree's dropped-page counts, its bookkeeping at the end)."""

    async def main():
        cfg = storage_config(
            write_policy="write_back",
            channel_capacity=64,  # 8 upload credits: uploads can hold all of L2
            device_tokens=32,
            host_tokens=48,
            storage_timeout=DEADLINE,
            **cfg_over,
        )
        async with HiCache(cfg, backend=backend_of(cfg), log=log) as cache:
            sched = ScriptedScheduler(cache, compute=synthetic_compute(cache), wait_prefetch=False)
            start = cache.system.now()
            for i in range(requests):
                await sched.run([[(f"r{i}", tokens(1000 * i, 16))]])
            took = cache.system.now() - start
            tree = cache.system.actors["tree"]
            stats = await cache.stats()
            return took, dict(stats.storage_dropped), tree.bookkeeping()

    return run_virtual(main)


def test_uploads_that_never_return_hold_no_cache_call():
    log = EventLog(capture=True)
    took, dropped, _ = run_requests(
        lambda cfg: HungWrites(namespace=namespace_of(cfg), store=MemoryStore()), log=log
    )
    assert took < DEADLINE / 10, f"the calls waited {took} s: on an upload's deadline"
    # L2's room was held by the hung uploads: L1 evictions dropped their nodes instead
    assert dropped.get("l2_held_by_uploads", 0) > 0
    held = [
        e["pages"]
        for e in log.events
        if e["event"] == "tree.storage_dropped" and e["reason"] == "l2_held_by_uploads"
    ]
    assert sum(held) == dropped["l2_held_by_uploads"]  # each drop is an event too


def enospc_after(limit: int):
    """A `write_value` that answers ENOSPC once `limit` values have been written: a
    filesystem that fills up."""
    real = file_backend.write_value
    written = [0]

    def write_value(job):
        if written[0] >= limit:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), job[2])
        written[0] += 1
        return real(job)

    return write_value


def test_a_full_filesystem_is_full_not_an_error_per_page(tmp_path, monkeypatch):
    monkeypatch.setattr(file_backend, "write_value", enospc_after(12))
    log = EventLog(capture=True)
    backends = []

    def open_file(cfg):
        backend = FileBackend(
            tmp_path, namespace=namespace_of(cfg), threads=0, emit=log.bind("storage").warning
        )
        backends.append(backend)
        return backend

    took, dropped, _ = run_requests(open_file, log=log)
    assert took < DEADLINE / 10
    stats = backends[0].stats()
    names = [e["event"] for e in log.events]
    assert stats["errors"] == 0 and "storage.error" not in names  # full is not an error
    assert names.count("uploader.retry") == 0  # a full store is not retried
    assert stats["full"] >= 1 and "storage.full" in names
    assert dropped.get("store_full", 0) > 0
    assert stats["stored_bytes"] <= stats["max_bytes"] <= stats["configured_max_bytes"]


@pytest.mark.parametrize("cap_pages", [6, 20])
def test_a_store_at_its_cap_keeps_the_cache_calls_whole(tmp_path, cap_pages):
    log = EventLog(capture=True)
    backends = []

    def open_file(cfg):
        ns = namespace_of(cfg)
        probe = FileBackend(tmp_path / "probe", namespace=ns, threads=0)
        value = probe._on_disk(file_backend.header_size(ns.key("0" * 64)) + 2 * 2 * 8 * 4 * 4)
        backend = FileBackend(
            tmp_path / "store",
            namespace=ns,
            threads=0,
            max_bytes=cap_pages * value,
            emit=log.bind("storage").warning,
        )
        backends.append(backend)
        return backend

    took, _dropped, _ = run_requests(open_file, log=log)
    assert took < DEADLINE / 10
    stats = backends[0].stats()
    assert stats["evictions"] > 0  # it ran at its cap
    assert stats["peak_stored_bytes"] <= stats["max_bytes"]
    assert stats["errors"] == 0 and stats["corrupt"] == 0


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs mounted for the test (root only): a filesystem that really fills."""
    import shutil
    import subprocess

    mount = tmp_path / "fs"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8); the ENOSPC stand-in covers it")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"no tmpfs could be mounted here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, check=False)


def test_a_real_full_tmpfs_is_full_and_the_calls_do_not_wait(small_tmpfs):
    log = EventLog(capture=True)
    backends = []

    def open_file(cfg):
        # the cap asked for is far above what 256 KiB holds: lowered at open, and the writes
        # still meet ENOSPC (temporary files, directories) before the lowered cap
        backend = FileBackend(
            small_tmpfs,
            namespace=namespace_of(cfg),
            threads=0,
            max_bytes=1 << 30,
            emit=log.bind("storage").warning,
        )
        backends.append(backend)
        return backend

    took, _dropped, _ = run_requests(open_file, log=log, requests=48)
    assert took < DEADLINE / 10
    stats = backends[0].stats()
    names = [e["event"] for e in log.events]
    assert "storage.cap_lowered" in names and stats["max_bytes"] < 1 << 30
    assert stats["errors"] == 0 and "storage.error" not in names
    assert names.count("uploader.retry") == 0
    assert stats["stored_bytes"] <= 256 * 1024
    assert stats["evictions"] > 0 or stats["full"] > 0  # it filled: evicting, or said full
