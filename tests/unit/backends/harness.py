"""One harness per backend kind, so the contract tests run unchanged over each: open
backends that share one underlying store, and tamper with stored values behind their back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hicache.backends.keys import Namespace
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.testing.conformance import Events

__all__ = ["Events", "FileHarness", "MemoryHarness", "ValueFileHarness"]


class ValueFileHarness:
    """The conformance kit's raw access (`read_raw`, `write_raw`) for a backend that keeps the
    file store's value files under `root` (file, nixl, hf3fs)."""

    root: Path

    def path(self, key: str) -> Path:
        from hicache.backends.file import value_path

        _, digest, name = key.split(":")
        return Path(value_path(self.root, digest, name))

    def read_raw(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def write_raw(self, key: str, value: bytes) -> None:
        self.path(key).parent.mkdir(parents=True, exist_ok=True)
        self.path(key).write_bytes(value)


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
