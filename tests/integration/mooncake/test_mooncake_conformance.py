"""The conformance kit (hicache.testing.conformance) over a real Mooncake Store on loopback
(one master and one storage process for the module; every test uses fresh namespaces)."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.backends.keys import Namespace
from hicache.backends.mooncake import MooncakeBackend
from hicache.testing.conformance import BackendConformance

pytestmark = pytest.mark.mooncake


class MooncakeHarness:
    keys_name_content = True  # an existing key counts as stored (mooncake/io.py's put_chunk)

    def __init__(self, store: Any, raw: Any) -> None:
        self.store = store
        self.raw = raw

    def open(self, namespace: Namespace, emit: Any) -> MooncakeBackend:
        return MooncakeBackend.from_spec(self.store.spec, namespace=namespace, emit=emit)

    def read_raw(self, key: str) -> bytes | None:
        if not self.raw.is_exist(key):
            return None
        return bytes(self.raw.get(key))

    def write_raw(self, key: str, value: bytes) -> None:
        self.raw.remove(key, True)
        assert self.raw.put(key, value) == 0


class TestMooncakeConformance(BackendConformance):
    @pytest.fixture
    def harness(self, store: Any, raw: Any) -> MooncakeHarness:
        return MooncakeHarness(store, raw)
