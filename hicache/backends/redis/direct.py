"""Page reads that land in place: a RESP connection whose GET replies are received straight
into the caller's page memory (standalone servers, TCP / TLS / unix socket).

Why not redis-py's parser: docs/decisions.md, "Redis page reads land in place". Here the
replies are read by `_Replies`, an `asyncio.BufferedProtocol` that, once a GET reply's length
line is read, hands the transport the target page's own pieces as the receive buffer; the
checksum then runs over the page in place. Everything but page reads stays on redis-py. A timeout or
a cancellation aborts the connection, so nothing more is written into any page.

Protocol subset: RESP2 replies `+`, `-`, `:` and `$` (no arrays: the commands sent here never
produce one). A length that differs from the page's is drained without being stored and
reported, so a foreign or torn value is a miss. Any protocol surprise aborts the connection:
the transport then writes nothing more into any page.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from hicache.backends.redis.spec import RedisSpec
from hicache.backends.redis.wire import Arg, pack

_SCRATCH = 64 * 1024  # receive buffer for everything but page bodies


@dataclass(frozen=True, slots=True)
class Landed:
    """A GET reply received into its target: `header` holds the value's first bytes (the
    framing header's room); the rest is in the target's pieces."""

    header: bytes


@dataclass(frozen=True, slots=True)
class WrongLength:
    """A value of another length than the target's: drained, not stored, but for its first
    bytes (`prefix`, up to the target's header room) so the caller can say why."""

    length: int
    prefix: bytes


@dataclass(slots=True)
class Target:
    """Where one GET reply goes: `header_size` bytes into a scratch header, then `pieces`."""

    header_size: int
    pieces: Sequence[memoryview]

    @property
    def total(self) -> int:
        return self.header_size + sum(p.nbytes for p in self.pieces)


class ProtocolFailure(RedisConnectionError):
    """The server sent something this reader does not expect; the connection is dropped."""


class _Replies(asyncio.BufferedProtocol):
    """Parses the replies to one batch of commands at a time (`expect`). Owned by one
    DirectConnection; runs in its event loop's callbacks."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._scratch = bytearray(_SCRATCH)
        self._start = self._end = 0  # unparsed bytes are _scratch[_start:_end]
        self._pending: deque[Target | None] = deque()
        self._replies: list[Any] = []
        self._done: asyncio.Future[list[Any]] | None = None
        self._lost: BaseException | None = None
        # the reply being received: body windows (header room, then pieces) and progress
        self._windows: list[memoryview] = []
        self._window = 0
        self._offset = 0
        self._header: bytearray | None = None
        self._drain = 0  # bytes of a wrong-length value still to skip (then CRLF)
        self._drained_length = 0
        self._prefix = bytearray()  # the wrong-length value's first bytes
        self._prefix_room = 0
        self._crlf = False  # a body ended; its CRLF comes next, then `_ended` is its reply
        self._ended: Any = None

    # --- used by DirectConnection -------------------------------------------------------------

    def expect(
        self, targets: Sequence[Target | None], loop: asyncio.AbstractEventLoop
    ) -> asyncio.Future[list[Any]]:
        if self._lost is not None:
            raise RedisConnectionError(f"connection lost: {self._lost}")
        if self._pending or self._windows:
            raise RuntimeError("a batch is already in flight on this connection")
        self._pending.extend(targets)
        self._replies = []
        self._done = loop.create_future()
        if self._start < self._end:  # bytes that arrived unasked: not a reply to anything of ours
            self._fail(ProtocolFailure("unexpected data from the server"))
        return self._done

    # --- asyncio.BufferedProtocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._windows:
            return self._windows[self._window][self._offset :]
        if self._end == len(self._scratch):
            if self._start:
                unparsed = self._end - self._start
                self._scratch[:unparsed] = self._scratch[self._start : self._end]
                self._start, self._end = 0, unparsed
            else:  # one line longer than the buffer (an error text, a drained value's length)
                self._scratch.extend(bytes(len(self._scratch)))
        return memoryview(self._scratch)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._windows:
                self._advance_body(nbytes)
            else:
                self._end += nbytes
            self._parse()
        except ProtocolFailure as failure:
            self._fail(failure)
        except ValueError as error:  # a length or integer line that is not a number
            self._fail(ProtocolFailure(f"malformed reply: {error}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc or RedisConnectionError("closed by the server")
        self._windows = []  # nothing more is written into any page
        if self._done is not None and not self._done.done():
            self._done.set_exception(RedisConnectionError(f"connection lost: {self._lost}"))

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost reports it

    # --- parsing --------------------------------------------------------------------------------

    def _fail(self, failure: BaseException) -> None:
        self._windows = []
        if self._done is not None and not self._done.done():
            self._done.set_exception(failure)
        if self.transport is not None:
            self.transport.abort()

    def _advance_body(self, nbytes: int) -> None:
        self._offset += nbytes
        while self._windows and self._offset == self._windows[self._window].nbytes:
            self._window += 1
            self._offset = 0
            if self._window == len(self._windows):
                self._windows = []
                self._body_done(Landed(bytes(self._header or b"")))

    def _body_done(self, reply: Any) -> None:
        self._crlf, self._ended = True, reply

    def _finish(self, reply: Any) -> None:
        self._pending.popleft()
        self._replies.append(reply)
        if not self._pending and self._done is not None and not self._done.done():
            self._done.set_result(self._replies)

    def _parse(self) -> None:
        buf = self._scratch
        while self._start < self._end:
            if self._crlf:
                if self._end - self._start < 2:
                    return
                if buf[self._start : self._start + 2] != b"\r\n":
                    raise ProtocolFailure("bulk reply not terminated by CRLF")
                self._start += 2
                self._crlf = False
                self._finish(self._ended)  # a reply counts only once its terminator is read
                continue
            if self._drain:
                step = min(self._drain, self._end - self._start)
                keep = min(step, self._prefix_room - len(self._prefix))
                self._prefix += buf[self._start : self._start + keep]
                self._start += step
                self._drain -= step
                if not self._drain:
                    self._body_done(WrongLength(self._drained_length, bytes(self._prefix)))
                continue
            if not self._pending:
                raise ProtocolFailure("reply to no command")
            eol = buf.find(b"\r\n", self._start, self._end)
            if eol < 0:
                return
            kind, text = buf[self._start], bytes(buf[self._start + 1 : eol])
            if (
                kind == ord("$")
                and self._pending[0] is None
                and int(text) >= 0
                and self._end - (eol + 2) < int(text) + 2
            ):
                return  # a plain command's bulk reply, not all here yet: parse it whole later
            self._start = eol + 2
            if kind == ord("+"):
                self._finish(text.decode(errors="replace"))
            elif kind == ord("-"):
                self._finish(error_reply(text.decode(errors="replace")))
            elif kind == ord(":"):
                self._finish(int(text))
            elif kind == ord("$"):
                self._bulk(int(text))
            else:
                raise ProtocolFailure(f"unexpected reply type {chr(kind)!r}")

    def _bulk(self, length: int) -> None:
        if length < 0:
            self._finish(None)
            return
        target = self._pending[0]
        if target is None:  # a plain command's bulk reply (all of it is here: see _parse)
            value = bytes(self._scratch[self._start : self._start + length])
            self._start += length
            self._body_done(value)
            return
        if length != target.total:
            self._drain, self._drained_length = length, length
            self._prefix, self._prefix_room = bytearray(), target.header_size
            if not length:
                self._body_done(WrongLength(0, b""))
            return
        self._header = bytearray(target.header_size)
        self._windows = [w for w in (memoryview(self._header), *target.pieces) if w.nbytes]
        self._window = self._offset = 0
        if not self._windows:  # an empty value: nothing to receive
            self._body_done(Landed(b""))
            return
        # bytes of the body that came with its length line: copy them over, then let the
        # transport write the rest in place
        with memoryview(self._scratch) as scratch:  # released at once: the scratch may grow later
            while self._windows and self._start < self._end:
                window = self._windows[self._window]
                step = min(window.nbytes - self._offset, self._end - self._start)
                window[self._offset : self._offset + step] = scratch[
                    self._start : self._start + step
                ]
                self._start += step
                self._advance_body(step)
        if self._windows:
            self._start = self._end = 0  # scratch is empty: reuse it from the start


def error_reply(text: str) -> Exception:
    """The exception redis-py's own parser makes of an error reply (OutOfMemoryError for OOM,
    NoPermissionError for NOPERM, AuthenticationError for WRONGPASS...), so events and failure
    classes read the same on both paths; a plain ResponseError where that is unavailable."""
    try:
        from redis._parsers.base import BaseParser

        error = BaseParser.parse_error(text)
    except Exception:  # noqa: BLE001 - another redis-py's internals
        return ResponseError(text)
    return error if isinstance(error, Exception) else ResponseError(text)


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
