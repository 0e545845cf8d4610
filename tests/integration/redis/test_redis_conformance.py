"""The conformance kit (hicache.testing.conformance) over Redis: a real redis-server per test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from hicache.backends.keys import Namespace
from hicache.backends.redis import RedisBackend
from hicache.testing.conformance import BackendConformance, stall_process
from hicache.testing.redis_server import RedisServer

pytestmark = pytest.mark.redis


class RedisHarness:
    stall_grace = 3.0  # the spec's 1 s socket timeout, plus a reconnect

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)

    def open(self, namespace: Namespace, emit: Any) -> RedisBackend:
        return RedisBackend.from_spec(self.server.url, namespace=namespace, emit=emit, timeout=1.0)

    def read_raw(self, key: str) -> bytes | None:
        value = self.client.get(key)
        return None if value is None else bytes(value)

    def write_raw(self, key: str, value: bytes) -> None:
        self.client.set(key, value)

    def stall(self) -> Any:
        assert self.server.pid is not None
        return stall_process(self.server.pid)


class TestRedisConformance(BackendConformance):
    @pytest.fixture
    def harness(self, server: RedisServer) -> Iterator[RedisHarness]:
        h = RedisHarness(server)
        yield h
        h.client.close()
