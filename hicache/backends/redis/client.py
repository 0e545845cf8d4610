"""The redis.asyncio client a RedisBackend talks through, and how its failures are classed.

`RedisLink` owns one client: a `Redis` over a `BlockingConnectionPool` (TCP, TLS or unix
socket), whose commands are written straight onto pooled connections (wire.py), or a
`RedisCluster`, which routes each command to its shard. Nothing connects until the first call;
every connect, read, write and pool wait is bounded by the spec's timeouts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

import hicache.backends.redis.wire as wire
from hicache.backends.redis.direct import DirectPool, Target
from hicache.backends.redis.spec import RedisSpec
from hicache.backends.redis.wire import Arg, joined

FAILURES = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)
"""Everything a call may raise that is the store's doing, not a programming error."""

_UNREACHABLE = (
    RedisConnectionError,  # includes a refused login (AuthenticationError)
    RedisTimeoutError,
    OSError,
    asyncio.TimeoutError,
    ClusterDownError,
    ClusterError,
    RedisClusterException,  # e.g. no startup node reachable
)


def is_unreachable(error: BaseException) -> bool:
    """A failure of the connection or the server as a whole (vs. one refused command)."""
    return isinstance(error, _UNREACHABLE)


def is_wrong_type(reply: Any) -> bool:
    """The key holds a non-string value: another program's key, never one of ours."""
    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")


def _client(spec: RedisSpec) -> aioredis.Redis | RedisCluster:
    common: dict[str, Any] = dict(
        username=spec.username,
        password=spec.password,
        socket_timeout=spec.timeout_s,
        socket_connect_timeout=spec.connect_timeout_s,
        # Reconnect once at once on a dropped connection (a restarted server); a timeout is
        # not retried, so a stuck server costs one timeout per call.
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        client_name="hicache",
    )
    if spec.tls:
        common.update(
            ssl_ca_certs=spec.tls_ca,
            ssl_certfile=spec.tls_cert,
            ssl_keyfile=spec.tls_key,
            ssl_cert_reqs="required" if spec.tls_verify else "none",
            ssl_check_hostname=spec.tls_verify and spec.tls_check_hostname,
        )
    if spec.cluster:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in spec.endpoints],
            max_connections=spec.pool,  # per node; RedisBackend keeps calls within it
            ssl=spec.tls,
            **common,
        )
    if spec.path is not None:
        where: dict[str, Any] = dict(
            connection_class=aioredis.UnixDomainSocketConnection, path=spec.path
        )
    else:
        host, port = spec.endpoints[0]
        connection_class = aioredis.SSLConnection if spec.tls else aioredis.Connection
        where = dict(connection_class=connection_class, host=host, port=port)
    pool = aioredis.BlockingConnectionPool(
        max_connections=spec.pool, timeout=spec.timeout_s, db=spec.db, **where, **common
    )
    return aioredis.Redis.from_pool(pool)


class RedisLink:
    """Sends batches of commands; owns the client. Used from one event loop."""

    def __init__(self, spec: RedisSpec) -> None:
        self.client = _client(spec)
        self._pool = None if isinstance(self.client, RedisCluster) else self.client.connection_pool
        self._direct = None if spec.cluster else DirectPool(spec)

    @property
    def reads_in_place(self) -> bool:
        """Whether `read_into` is available (standalone servers; not through the cluster client)."""
        return self._direct is not None

    async def read_into(
        self, commands: Sequence[Sequence[Arg]], targets: Sequence[Target | None]
    ) -> list[Any]:
        """Like `send`, over the in-place connections (direct.py): each GET reply that has a
        Target is received straight into its pieces; a None target is a plain reply. Standalone
        servers only."""
        if self._direct is None:
            raise RuntimeError("in-place reads need a standalone server")
        return await self._direct.call(commands, targets)

    async def send(self, commands: Sequence[Sequence[Arg]]) -> list[Any]:
        """Replies to `commands`, in order, as one pipelined round trip (per shard); an error
        reply comes back as its ResponseError. Raises FAILURES when the call as a whole fails."""
        if self._pool is not None:
            return await wire.call(self._pool, commands)
        if len(commands) == 1:
            try:
                return [await self.client.execute_command(*map(joined, commands[0]))]
            except ResponseError as error:
                return [error]
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*map(joined, command))
        return await pipe.execute(raise_on_error=False)

    async def scan(self, match: str, count: int) -> AsyncIterator[str]:
        """Every key matching the glob `match` (on every primary of a cluster), as str."""
        async for key in self.client.scan_iter(match=match, count=count):
            yield key.decode() if isinstance(key, bytes) else key

    async def aclose(self) -> None:
        if self._direct is not None:
            self._direct.close()
        await self.client.aclose()
