"""The conformance kit (hicache.testing.conformance) over the embedded backends: memory and file."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import trio
import trio.testing

from hicache.backends.file import FileBackend
from hicache.backends.keys import Namespace
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.testing.conformance import CALL_BOUND_S, BackendConformance, BoundedCalls, namespace

from .harness import ValueFileHarness


class ManualClock:
    """A clock the test moves by hand (expiry without waiting)."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class MemoryHarness:
    def __init__(self) -> None:
        self.clock = ManualClock(1000.0)
        self.store = MemoryStore(clock=self.clock)

    def open(self, namespace: Namespace, emit: Any) -> MemoryBackend:
        return MemoryBackend(namespace=namespace, emit=emit, store=self.store)

    def read_raw(self, key: str) -> bytes | None:
        return self.store.get(key)

    def write_raw(self, key: str, value: bytes) -> None:
        self.store.put(key, value)

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds


class FileHarness(ValueFileHarness):
    def __init__(self, root: Path) -> None:
        self.root = root
        self.clock = ManualClock(time.time())

    def open(self, namespace: Namespace, emit: Any) -> FileBackend:
        return FileBackend(self.root, namespace=namespace, emit=emit, threads=2, clock=self.clock)

    def write_raw(self, key: str, value: bytes) -> None:
        path = self.path(key)
        stat = path.stat() if path.exists() else None
        super().write_raw(key, value)
        if stat is not None:  # keep the expiry the backend keeps in the file's times
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds


class TestMemoryConformance(BackendConformance):
    @pytest.fixture
    def harness(self) -> MemoryHarness:
        return MemoryHarness()


class TestFileConformance(BackendConformance):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> FileHarness:
        return FileHarness(tmp_path / "store")


class HangingBackend(MemoryBackend):
    """Answers everything but reads, which never return (until cancelled)."""

    async def get_into(self, keys: Any, targets: Any) -> int:
        await anyio.Event().wait()
        raise AssertionError("unreachable: the event is never set")


def _on_virtual_time(body: Any) -> None:
    """Run `body` on trio with a clock that jumps to the next deadline: bounds of tens of
    seconds pass at once."""
    trio.run(body, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_call_that_never_returns_fails_naming_it_at_the_bound() -> None:
    backend = BoundedCalls(HangingBackend(namespace=namespace("t"), store=MemoryStore()))
    waited: list[float] = []

    async def body() -> None:
        start = anyio.current_time()
        try:
            await backend.get_into([], [])
        finally:
            waited.append(anyio.current_time() - start)

    with pytest.raises(pytest.fail.Exception, match=r"HangingBackend\.get_into did not return"):
        _on_virtual_time(body)
    assert waited == [pytest.approx(CALL_BOUND_S)]


def test_the_bound_lets_the_callers_own_deadline_and_answers_through() -> None:
    inner = HangingBackend(namespace=namespace("t"), store=MemoryStore())
    backend = BoundedCalls(inner)
    seen: list[object] = []

    async def body() -> None:
        with anyio.move_on_after(0.5) as scope:  # the test's own deadline, shorter
            await backend.get_into([], [])
        seen.append(scope.cancelled_caught)
        seen.append(await backend.exists([]))  # calls that return pass their answer on
        seen.append(backend.namespace is inner.namespace)  # the rest is the backend's

    _on_virtual_time(body)
    assert seen == [True, 0, True]
