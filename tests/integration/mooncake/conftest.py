"""Fixtures: a real Mooncake Store on loopback (see hicache.testing.mooncake_store)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache.testing.mooncake_store import Store, import_error, start_store


@pytest.fixture(scope="session")
def mooncake_ready() -> None:
    reason = import_error()
    if reason:
        pytest.skip(reason)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


@pytest.fixture(scope="module")
def store(mooncake_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = start_store(tmp_path_factory.mktemp("mooncake"))
    yield s
    s.stop()


@pytest.fixture
def private_store(mooncake_ready: None, tmp_path: Path) -> Iterator[Store]:
    """A store of the test's own, for tests that kill parts of it."""
    s = start_store(tmp_path)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def raw(store: Store) -> Iterator[Any]:
    """A plain Mooncake client on the module's store, to read and plant values behind the
    backend."""
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
