"""The file store's timestamps: recency in mtime (every read beside other instances, a read of
an mtime at least TOUCH_AFTER_S old alone), expiry in atime (a ttl's deadline, later than
mtime), and values without a ttl on the kernel's clock keeping the kernel's times."""

from __future__ import annotations

import os
import time

import pytest

from hicache.backends.file import FileBackend, value_path
from hicache.backends.file import io as file_io
from hicache.backends.file.index import (
    TOUCH_AFTER_S,
    atime_ns_to_expiry,
    expiry_to_atime_ns,
    scan,
)
from hicache.backends.file.native import native_file_io

from .conftest import FakeHostPool, page_keys

pytestmark = pytest.mark.anyio

NS = 1_000_000_000


def counts(paths: list[str], now: float) -> set[int]:
    """count_present of `paths` at `now` by the Python loop and the compiled one (if built)."""
    native = native_file_io()
    found = {file_io.count_present(paths, now)}
    if native is not None:
        found.add(native.count_present(paths, now))
    return found


async def store(backend: FileBackend, ns, n: int, **kwargs) -> tuple[list[str], list[str]]:
    pool = FakeHostPool(pages=n)
    for i in range(n):
        pool.fill(i, seed=i)
    keys = page_keys(ns, n)
    assert await backend.set_from(keys, [pool.page_buffer(i) for i in range(n)], **kwargs) == n
    paths = [value_path(backend.root, ns.digest, ns.page_hash_of(k)) for k in keys]
    return keys, paths


async def read(backend: FileBackend, keys: list[str]) -> int:
    out = FakeHostPool(pages=len(keys))
    return await backend.get_into(keys, [out.page_buffer(i) for i in range(len(keys))])


async def test_a_value_without_a_ttl_never_expires_on_the_kernel_clock(tmp_path, ns):
    backend = FileBackend(tmp_path, namespace=ns)
    keys, paths = await store(backend, ns, 2)
    st = os.stat(paths[0])
    assert st.st_atime_ns <= st.st_mtime_ns
    # Whatever tail the kernel's atime has, at or before mtime it is no deadline: put it on
    # the mark (as it would be one write in a million) and it still never expires.
    marked = expiry_to_atime_ns(st.st_mtime_ns / NS - 1)
    os.utime(paths[0], ns=(marked, st.st_mtime_ns))
    assert atime_ns_to_expiry(marked, st.st_mtime_ns) is None
    assert counts(paths, time.time() + 10**6) == {2}
    assert await read(backend, keys) == 2
    await backend.aclose()
    reopened = FileBackend(tmp_path, namespace=ns, clock=lambda: time.time() + 10**6)
    assert await read(reopened, keys) == 2 and reopened.stats()["expired"] == 0
    await reopened.aclose()


async def test_a_ttl_expires_on_the_kernel_clock(tmp_path, ns):
    backend = FileBackend(tmp_path, namespace=ns)
    assert backend.enforces_ttl
    t0 = time.time()
    keys, paths = await store(backend, ns, 2, ttl=1000.0)
    st = os.stat(paths[0])
    deadline = atime_ns_to_expiry(st.st_atime_ns, st.st_mtime_ns)
    assert deadline is not None and t0 + 1000 <= deadline <= time.time() + 1000.002
    assert counts(paths, deadline - 1) == {2} and counts(paths, deadline) == {0}
    assert await read(backend, keys) == 2
    later = FileBackend(tmp_path, namespace=ns, clock=lambda: deadline + 1)  # type: ignore[operator]
    assert await read(later, keys) == 0 and later.stats()["expired"] >= 1
    await later.aclose()
    await backend.aclose()


async def test_reads_beside_another_instance_touch_mtime(tmp_path, ns):
    now_a, now_b = [1000.0], [2000.0]
    a = FileBackend(tmp_path, namespace=ns, clock=lambda: now_a[0])
    keys, paths = await store(a, ns, 2)
    assert os.stat(paths[0]).st_mtime_ns == 1000 * NS
    b = FileBackend(tmp_path, namespace=ns, clock=lambda: now_b[0])
    assert await read(b, keys[:1]) == 1
    assert os.stat(paths[0]).st_mtime_ns == 2000 * NS  # a's rescan sees b's read
    now_a[0] += 0.25  # well within TOUCH_AFTER_S: beside b, a's read touches all the same
    assert await read(a, keys[1:]) == 1
    assert os.stat(paths[1]).st_mtime_ns == 1000 * NS + NS // 4
    await b.aclose()
    await a.aclose()


async def test_alone_a_read_touches_mtime_once_it_is_touch_after_s_old(tmp_path, ns):
    now = [1000.0]
    backend = FileBackend(tmp_path, namespace=ns, clock=lambda: now[0])
    keys, paths = await store(backend, ns, 2)
    now[0] += TOUCH_AFTER_S / 2
    assert await read(backend, keys) == 2
    assert [os.stat(p).st_mtime_ns for p in paths] == [1000 * NS] * 2  # recent: untouched
    now[0] += TOUCH_AFTER_S
    assert await read(backend, keys[1:]) == 1
    assert os.stat(paths[1]).st_mtime_ns == round(now[0] * NS)
    await backend.aclose()
    # A restart orders by mtime: the value read last is the most recent.
    found = scan(os.path.join(tmp_path, ns.digest))
    assert [page_hash for _, page_hash, _, _ in found] == [ns.page_hash_of(k) for k in keys]
