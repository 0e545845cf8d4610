"""The storage faults the simulation injects (`hicache.testing.FaultyBackend`): each does what
it says, on the actor system's (here virtual) clock, and says how often it was applied."""

from __future__ import annotations

import anyio
import pytest

from hicache.backends.file import FileBackend
from hicache.backends.keys import Namespace
from hicache.backends.memory import MemoryBackend
from hicache.radix.hashes import chain_page_hashes
from hicache.testing import BackendFaults, FaultyBackend, run_virtual

NS = Namespace(model="sim/faults", kv="mha:2:2:4:bfloat16", page_size=4)
KEYS = [NS.key(h) for h in chain_page_hashes(list(range(12)), 4)]  # three pages


def pages(fill: int | None = None) -> list[list[memoryview]]:
    out = []
    for i in range(len(KEYS)):
        data = bytearray(64) if fill is None else bytearray([(fill + i) % 256]) * 64
        out.append([memoryview(data)])
    return out


@pytest.fixture(params=["memory", "file"])
def inner(request, tmp_path):
    if request.param == "memory":
        return MemoryBackend(namespace=NS)
    return FileBackend(tmp_path, namespace=NS, threads=0)


def test_a_corrupted_read_is_a_short_read_never_wrong_bytes(inner):
    async def main():
        backend = FaultyBackend(inner, BackendFaults(corrupt_gets={0}))
        assert await backend.set_from(KEYS, pages(7)) == 3
        got = pages()
        n = await backend.get_into(KEYS, got)  # the middle page was corrupted just before
        assert n == 1 and backend.injected["corrupt"] == 1
        assert bytes(got[0][0]) == bytes(pages(7)[0][0])
        assert inner.stats()["corrupt"] == 1
        assert await backend.exists(KEYS) == 1  # the corrupt value was deleted
        return True

    assert run_virtual(main)


def test_hung_calls_never_return_until_cancelled(inner):
    async def main():
        backend = FaultyBackend(inner, BackendFaults(hang_sets={1}, hang_exists={0}))
        assert await backend.set_from(KEYS, pages(1)) == 3  # call 0: fine
        with anyio.move_on_after(5) as scope:
            await backend.set_from(KEYS, pages(2))  # call 1 hangs
        assert scope.cancelled_caught and anyio.current_time() >= 5
        with anyio.move_on_after(1) as scope:
            await backend.exists(KEYS)
        assert scope.cancelled_caught
        assert await backend.exists(KEYS) == 3  # call 1 of exists: fine
        assert backend.injected["hang"] == 2
        return True

    assert run_virtual(main)


def test_outage_windows_latency_and_slow_calls_follow_the_clock(inner):
    async def main():
        # down from 1 s to 2 s after the wrapper was made; the second read takes 3 s longer
        faults = BackendFaults(latency=0.01, outages=((1.0, 2.0),), delays={("get_into", 1): 3.0})
        backend = FaultyBackend(inner, faults)
        assert await backend.set_from(KEYS, pages(3)) == 3
        assert await backend.get_into(KEYS, pages()) == 3
        await anyio.sleep(1.5 - anyio.current_time())  # virtual time (run_virtual)
        assert await backend.exists(KEYS) == 0  # in the outage
        start = anyio.current_time()
        assert await backend.get_into(KEYS, pages()) == 3  # slow, and done after the outage
        assert anyio.current_time() - start >= 3.0
        assert await backend.exists(KEYS) == 3
        assert backend.injected == {"latency": 5, "outage": 1, "delay": 1}
        return True

    assert run_virtual(main)
