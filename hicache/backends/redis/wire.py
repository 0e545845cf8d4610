"""Commands written straight onto a pooled redis.asyncio connection (standalone servers only).

Why not redis-py's `execute_command`: it takes a value as one bytes-like argument, so a framed
page (header + pieces) would first be joined into a new buffer, on top of the copy the asyncio
transport makes anyway; fresh multi-MiB buffers cost page faults, and the extra copy cost a third
of the upload rate for 4 MiB pages. Here the header and the pieces go to the transport as they are.

A batch of commands is one pipelined round trip on one connection. All commands sent here are
idempotent (GET, GETEX, SET, EXISTS, UNLINK), so a batch whose connection drops is resent once
on a fresh connection; a timeout is not retried.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio import ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError


class Parts(tuple[bytes | memoryview, ...]):
    """One bulk-string argument made of several buffers, sent without joining them."""

    __slots__ = ()


Plain = bytes | str | int | memoryview
"""One argument as redis-py takes it."""
Arg = Plain | Parts


def joined(arg: Arg) -> Plain:
    """`arg` as one buffer, for clients that take values whole (the cluster client)."""
    return b"".join(arg) if isinstance(arg, Parts) else arg


def _bulk(arg: Arg, out: list[bytes | memoryview]) -> None:
    if isinstance(arg, Parts):
        out.append(b"$%d\r\n" % sum(memoryview(p).nbytes for p in arg))
        out.extend(arg)
        out.append(b"\r\n")
        return
    if isinstance(arg, str):
        arg = arg.encode()
    elif isinstance(arg, int):
        arg = b"%d" % arg
    out.append(b"$%d\r\n" % memoryview(arg).nbytes)
    out.append(arg)
    out.append(b"\r\n")


def pack(commands: Sequence[Sequence[Arg]]) -> list[bytes | memoryview]:
    """RESP encoding of `commands`, as a list of buffers for the transport to write in order."""
    out: list[bytes | memoryview] = []
    for command in commands:
        out.append(b"*%d\r\n" % len(command))
        for arg in command:
            _bulk(arg, out)
    return out


async def call(pool: ConnectionPool, commands: Sequence[Sequence[Arg]]) -> list[Any]:
    """Send `commands` in one round trip on one connection from `pool`; return their replies in
    order, an error reply as its ResponseError. Raises redis ConnectionError / TimeoutError when
    the connection fails (after one resend on a fresh connection for ConnectionError)."""
    packed = pack(commands)
    connection = await pool.get_connection()
    try:
        for attempt in (1, 2):
            try:
                await connection.send_packed_command(packed, check_health=False)
                replies: list[Any] = []
                for _ in commands:
                    try:
                        replies.append(await connection.read_response())
                    except ResponseError as error:
                        replies.append(error)
                return replies
            except RedisConnectionError:
                await connection.disconnect()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")
    finally:
        await pool.release(connection)
