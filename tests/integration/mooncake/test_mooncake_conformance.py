"""The conformance kit (hicache.testing.conformance) over a real Mooncake Store on loopback
(one master and one storage process for the module; every test uses fresh namespaces)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hicache.backends.keys import Namespace
from hicache.backends.mooncake import MooncakeBackend
from hicache.testing.conformance import BackendConformance

pytestmark = pytest.mark.mooncake


class MooncakeHarness:
    keys_name_content = True  # an existing key counts as stored (mooncake_io.put_chunk)

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


@pytest.fixture(scope="module")
def raw(store: Any) -> Iterator[Any]:
    """A plain Mooncake client, to read and plant values behind the backend."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert (
        client.setup(
            "127.0.0.1", store.metadata, 0, 16 << 20, "tcp", "", f"127.0.0.1:{store.rpc_port}"
        )
        == 0
    )
    yield client
    client.close()


class TestMooncakeConformance(BackendConformance):
    @pytest.fixture
    def harness(self, store: Any, raw: Any) -> MooncakeHarness:
        return MooncakeHarness(store, raw)
