"""Reads go on while every write thread is busy: the file store and the simple-store adapter
run `exists` and `get_into` on worker threads of their own, so a prefetch never queues
behind a backlog of uploads. Each test holds every write thread inside a write (a threading
event the write waits on) and reads meanwhile."""

from __future__ import annotations

import threading

import anyio
import pytest

from hicache.backends.file import FileBackend
from hicache.backends.file import backend as file_backend
from hicache.backends.simple import SimpleStoreBackend

from .conftest import FakeHostPool, page_keys

pytestmark = pytest.mark.anyio

THREADS = 2
BOUND_S = 30  # a deadlock fails the test instead of hanging it


class _Held:
    """Counts the writes inside `wait` and holds them there until `release`."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.gate = threading.Event()

    def wait(self) -> None:
        self.entered.release()
        assert self.gate.wait(BOUND_S), "the held write was never released"

    async def all_inside(self, n: int) -> None:
        for _ in range(n):
            assert await anyio.to_thread.run_sync(self.entered.acquire, True, BOUND_S)


def pool_of(n: int) -> FakeHostPool:
    pool = FakeHostPool(pages=n)
    for i in range(n):
        pool.fill(i, seed=i)
    return pool


async def _read_while_writes_are_held(backend, held: _Held, ns, stored: list[str]) -> None:
    pool = pool_of(THREADS + 1)
    more = page_keys(ns, THREADS, start=1000 * ns.page_size)
    out = FakeHostPool(pages=len(stored))
    with anyio.fail_after(BOUND_S):
        async with anyio.create_task_group() as tg:
            for i, key in enumerate(more):  # one write per write thread, each held inside
                tg.start_soon(backend.set_from, [key], [pool.page_buffer(i)])
            await held.all_inside(THREADS)
            assert await backend.exists(stored) == len(stored)
            got = await backend.get_into(stored, [out.page_buffer(i) for i in range(len(stored))])
            assert got == len(stored)
            held.gate.set()
    src = pool_of(len(stored))
    assert all(out.page_bytes(i) == src.page_bytes(i) for i in range(len(stored)))


async def test_the_file_store_reads_while_its_write_threads_are_busy(tmp_path, ns, monkeypatch):
    backend = FileBackend(tmp_path, namespace=ns, threads=THREADS)
    # Beside another writer, so that `exists` reads the files too (not the index alone).
    other = FileBackend(tmp_path, namespace=ns, threads=0)
    stored = page_keys(ns, 3)
    src = pool_of(3)
    assert await backend.set_from(stored, [src.page_buffer(i) for i in range(3)]) == 3
    held = _Held()
    write_all = file_backend._write_all

    def held_write_all(jobs):
        held.wait()
        return write_all(jobs)

    monkeypatch.setattr(file_backend, "_write_all", held_write_all)
    await _read_while_writes_are_held(backend, held, ns, stored)
    await backend.aclose()
    await other.aclose()


class _DictStore:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.held: _Held | None = None

    def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    def put(self, key: str, value: bytes) -> None:
        if self.held is not None:
            self.held.wait()
        self.values[key] = value


async def test_the_simple_store_adapter_reads_while_its_write_threads_are_busy(ns):
    store = _DictStore()
    backend = SimpleStoreBackend(store, namespace=ns, threads=THREADS)
    stored = page_keys(ns, 3)
    src = pool_of(3)
    assert await backend.set_from(stored, [src.page_buffer(i) for i in range(3)]) == 3
    store.held = _Held()
    await _read_while_writes_are_held(backend, store.held, ns, stored)
