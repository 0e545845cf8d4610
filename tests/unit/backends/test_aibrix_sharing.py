"""The AIBrix backend's share of its process-wide connector, without aibrix-kvcache: the
connector is stood in for, so what is checked is the backend's own bookkeeping. The real
connector's behaviour is in tests/aibrix (its own venv)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import hicache.backends.aibrix as aibrix

pytestmark = pytest.mark.anyio


class _Absent:
    def is_ok(self) -> bool:
        return False

    def is_not_found(self) -> bool:
        return True


class _Connector:
    async def exists(self, key: bytes) -> _Absent:
        return _Absent()


async def test_first_calls_at_once_take_one_share_and_close_gives_it_back(
    tmp_path, monkeypatch, ns
):
    shares: list[int] = []  # +1 per acquire, -1 per release

    def acquire(path: str, threads: int, ttl: int | None) -> _Connector:
        shares.append(1)
        return _Connector()

    def release(path: str) -> None:
        shares.append(-1)

    monkeypatch.setattr(aibrix, "_acquire", acquire)
    monkeypatch.setattr(aibrix, "_release", release)
    backend = aibrix.AibrixBackend(str(tmp_path / "db"), namespace=ns)
    (key,) = ns.keys(["0" * 64])
    got: list[Any] = []

    async def probe() -> None:
        got.append(await backend.exists([key]))

    async with anyio.create_task_group() as tg:  # both reach the unopened connector at once
        tg.start_soon(probe)
        tg.start_soon(probe)
    await backend.aclose()
    assert got == [0, 0]
    assert shares == [1, -1]  # one share taken, and given back: the connector can close
