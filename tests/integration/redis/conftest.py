"""Fixtures for the Redis backend tests: real redis-server processes on free loopback ports
(one per test, or a module's three-master cluster), namespaces, layer-first host pages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_helpers import Events, namespace

from hicache.backends.keys import Namespace
from hicache.testing.redis_server import RedisClusterServers, RedisServer, redis_server_binary


def _need_server() -> None:
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does)")


@pytest.fixture
def redis_installed() -> None:
    """Skip, with the line every Redis test gives, where no redis-server is installed: for the
    tests that start servers of their own."""
    _need_server()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio runs on asyncio only


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Any]:
    """Start servers with extra redis-server arguments; all are stopped at teardown."""
    _need_server()
    started: list[RedisServer] = []

    def start(*extra_args: str, unix_socket: bool = False) -> RedisServer:
        server = RedisServer(
            tmp_path / f"redis{len(started)}", unix_socket=unix_socket, extra_args=extra_args
        )
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def server(server_factory) -> RedisServer:
    return server_factory()


@pytest.fixture
def inspect(server: RedisServer) -> Iterator[redis.Redis]:
    """A plain synchronous client on the server, to look at and tamper with stored values."""
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
    yield client
    client.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[RedisClusterServers]:
    _need_server()
    servers = RedisClusterServers(tmp_path_factory.mktemp("cluster"))
    with servers:
        yield servers


@pytest.fixture
def events() -> Events:
    return Events()


@pytest.fixture
def ns() -> Namespace:
    return namespace()
