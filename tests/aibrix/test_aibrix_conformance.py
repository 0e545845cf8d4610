"""The AIBrix KVCache backend over the real `aibrix-kvcache` package (its RocksDB connector):
the conformance kit. aibrix-kvcache pins redis==6.0.0, so these tests run in a venv of their
own (`make aibrix-env`; `.venv-aibrix/bin/python -m pytest tests/aibrix`); elsewhere they skip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hicache.backends.aibrix import AibrixBackend, aibrix_missing
from hicache.backends.keys import Namespace
from hicache.testing.conformance import BackendConformance

pytestmark = pytest.mark.aibrix
if aibrix_missing() is not None:  # one line in the summary, not one per test
    pytest.skip(str(aibrix_missing()), allow_module_level=True)


class AibrixHarness:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.backends: list[AibrixBackend] = []

    def open(self, ns: Namespace, emit: Any) -> AibrixBackend:
        backend = AibrixBackend.from_spec(f"aibrix:{self.root}", namespace=ns, emit=emit)
        self.backends.append(backend)
        return backend

    def _store(self) -> Any:
        from hicache.backends.aibrix import _Shared

        return _Shared.open[str(self.root)][0].store  # the connector's open Rdict

    def read_raw(self, key: str) -> bytes | None:
        value = self._store().get(key.encode())
        return None if value is None else bytes(value)

    def write_raw(self, key: str, value: bytes) -> None:
        self._store().put(key.encode(), value)


class TestAibrixConformance(BackendConformance):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> AibrixHarness:
        return AibrixHarness(tmp_path / "aibrix")
