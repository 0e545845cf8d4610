"""Page reads that land in place: a RESP connection whose GET replies are received straight
into the caller's page memory (standalone servers, TCP / TLS / unix socket).

Why: redis-py's parser turns every bulk reply into a `bytes` (the socket data is copied into
the stream buffer, out of it, and sliced once more), and the page still has to be copied out
of that. Here the replies are read by redis_replies.py, which has the transport receive a page's
body into the page's own pieces, so the kernel's copy is the only one; the checksum then runs
over the page in place. Everything but page reads stays on redis-py. A timeout or a
cancellation aborts the connection, so nothing more is written into any page.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from typing import Any

import anyio
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError

from hicache.backends.redis_replies import (
    Landed,
    ProtocolFailure,
    Target,
    WrongLength,
    _Replies,
    error_reply,
)
from hicache.backends.redis_spec import RedisSpec
from hicache.backends.redis_wire import Arg, pack

__all__ = [
    "DirectConnection",
    "DirectPool",
    "Landed",
    "ProtocolFailure",
    "Target",
    "WrongLength",
    "error_reply",
]  # the reply types are re-exported: callers import them from here


def _ssl_context(spec: RedisSpec) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=spec.tls_ca)
    if not spec.tls_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context.check_hostname = spec.tls_check_hostname
    if spec.tls_cert:
        context.load_cert_chain(spec.tls_cert, spec.tls_key)
    return context


_SMALL = 64 * 1024


def _coalesced(buffers: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """`buffers` with each run of small ones joined: one write (one send) per run, while large
    buffers (page pieces) go as they are."""
    out: list[bytes | memoryview] = []
    small: list[bytes | memoryview] = []
    for buffer in buffers:
        if memoryview(buffer).nbytes < _SMALL:
            small.append(buffer)
            continue
        if small:
            out.append(b"".join(small))
            small = []
        out.append(buffer)
    if small:
        out.append(b"".join(small))
    return out


class DirectConnection:
    """One connection: `call` sends a batch of commands and returns their replies, GET replies
    with a Target landing in place. Not shared between concurrent calls."""

    def __init__(self, replies: _Replies) -> None:
        self._replies = replies
        self.broken = False

    @classmethod
    async def open(cls, spec: RedisSpec) -> DirectConnection:
        """Connect and log in (AUTH, SELECT); raises redis ConnectionError / AuthenticationError
        or TimeoutError, bounded by the spec's connect timeout."""
        loop = asyncio.get_running_loop()
        with anyio.fail_after(spec.connect_timeout_s):
            if spec.path is not None:
                _, replies = await loop.create_unix_connection(_Replies, spec.path)
            else:
                host, port = spec.endpoints[0]
                tls = _ssl_context(spec) if spec.tls else None
                _, replies = await loop.create_connection(
                    _Replies, host, port, ssl=tls, server_hostname=host if tls else None
                )
        connection = cls(replies)
        try:
            hello: list[tuple[Arg, ...]] = []
            if spec.password is not None:
                hello.append(
                    ("AUTH", spec.username, spec.password)
                    if spec.username
                    else ("AUTH", spec.password)
                )
            if spec.db:
                hello.append(("SELECT", spec.db))
            hello.append(("CLIENT", "SETNAME", "hicache"))
            answers = await connection.call(
                hello, [None] * len(hello), timeout=spec.connect_timeout_s
            )
            for command, answer in zip(hello, answers):
                if isinstance(answer, Exception) and command[0] != "CLIENT":
                    raise AuthenticationError(f"{command[0]!s} refused: {answer}")
        except BaseException:
            connection.abort()
            raise
        return connection

    async def call(
        self, commands: Sequence[Sequence[Arg]], targets: Sequence[Target | None], *, timeout: float
    ) -> list[Any]:
        """Replies to `commands` in order (error replies as ResponseError, a GET with a target
        as Landed / WrongLength / None). On any failure, timeout or cancellation the
        connection is aborted (and `broken`) before this returns or raises."""
        replies = self._replies
        transport = replies.transport
        if self.broken or transport is None or transport.is_closing():
            raise RedisConnectionError("connection closed")
        try:
            done = replies.expect(targets, asyncio.get_running_loop())
            # Not writelines: before Python 3.12 that joins every buffer into one new bytes
            # first (a copy of each page of a SET). Large buffers go by themselves (write()
            # sends at once and copies only what the socket does not take); runs of small
            # ones are joined so a batch of small commands is still one send.
            for buffer in _coalesced(pack(commands)):
                transport.write(buffer)
            with anyio.fail_after(timeout):
                return await done
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        self.broken = True
        if self._replies.transport is not None:
            self._replies.transport.abort()
        self._replies._windows = []


class DirectPool:
    """Idle DirectConnections for reuse; the caller bounds how many are in use at once."""

    def __init__(self, spec: RedisSpec) -> None:
        self.spec = spec
        self._idle: list[DirectConnection] = []
        self._closed = False

    async def call(
        self, commands: Sequence[Sequence[Arg]], targets: Sequence[Target | None]
    ) -> list[Any]:
        """`DirectConnection.call` on an idle connection or a new one. A pooled connection
        that turns out dropped (a restarted server) is replaced and the batch resent once:
        the commands sent here are reads."""
        if self._closed:
            raise RedisConnectionError("pool closed")
        resent = False
        while True:
            fresh = not self._idle
            connection = self._idle.pop() if self._idle else await DirectConnection.open(self.spec)
            try:
                replies = await connection.call(commands, targets, timeout=self.spec.timeout_s)
            except RedisConnectionError:
                if fresh or resent:
                    raise
                resent = True
                continue
            if self.closed:  # close() may have run while this call was in flight
                connection.abort()
            else:
                self._idle.append(connection)
            return replies

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        for connection in self._idle:
            connection.abort()
        self._idle.clear()
