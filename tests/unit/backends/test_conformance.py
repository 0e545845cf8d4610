"""The conformance kit (hicache.testing.conformance) over the embedded backends: memory and file."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from hicache.backends.file import FileBackend
from hicache.backends.keys import Namespace
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.testing.conformance import BackendConformance

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
