"""One harness per backend kind, so the contract tests run unchanged over each: open
backends that share one underlying store, and tamper with stored values behind their back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hicache.backends.keys import Namespace
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.testing.conformance import Events

__all__ = ["Events", "FileHarness", "MemoryHarness"]


class MemoryHarness:
    kind = "memory"

    def __init__(self, tmp_path: Path) -> None:
        self.store = MemoryStore()

    def open(self, ns: Namespace, emit: Events | None = None, **options: Any) -> MemoryBackend:
        return MemoryBackend(namespace=ns, emit=emit, store=self.store, **options)

    def tamper(self, key: str, change: Callable[[bytes], bytes]) -> None:
        self.store.put(key, change(self.store.get(key)))

    def present(self, key: str) -> bool:
        return self.store.contains(key)


class FileHarness:
    kind = "file"

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "store"

    def open(self, ns: Namespace, emit: Events | None = None, **options: Any):
        from hicache.backends.file import FileBackend

        options.setdefault("threads", 2)
        return FileBackend(self.root, namespace=ns, emit=emit, **options)

    def path(self, key: str) -> Path:
        from hicache.backends.file import value_path

        ns_digest = key.split(":")[1]
        return Path(value_path(self.root, ns_digest, key.rsplit(":", 1)[1]))

    def tamper(self, key: str, change: Callable[[bytes], bytes]) -> None:
        p = self.path(key)
        p.write_bytes(change(p.read_bytes()))

    def present(self, key: str) -> bool:
        return self.path(key).exists()
