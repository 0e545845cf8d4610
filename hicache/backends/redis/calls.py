"""How a RedisBackend's commands reach the server: batches cut into pipelines sent concurrently
within the pool's permits, failures counted and reported as events (once per outage), and the
open-time check. Used from the backend's event loop only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from hicache.backends.base import BackendUnavailable, EventSink
from hicache.backends.fullness import WriteGate
from hicache.backends.redis.client import FAILURES, RedisLink, is_unreachable, is_wrong_type
from hicache.backends.redis.direct import Target
from hicache.backends.redis.spec import RedisSpec
from hicache.secrets import redact_text

Take = Callable[[int, Any], None]
"""Called with (command index, reply) for each reply; a failed command's reply is its error."""


def ignore(index: int, reply: Any) -> None:
    pass


def unlinks(keys: Sequence[str]) -> list[tuple[str, str]]:
    return [("UNLINK", key) for key in keys]


@dataclass(slots=True)
class Counters:
    """Mutated only by the owning RedisBackend and its RedisCalls."""

    exists_calls: int = 0
    probes: int = 0  # keys asked about by exists
    probe_hits: int = 0  # of which in the present prefix
    gets: int = 0  # pages asked for by get_into
    get_hits: int = 0  # pages in the verified prefix
    sets: int = 0  # pages offered to set_from
    set_ok: int = 0  # pages in the stored prefix
    deletes: int = 0  # keys given to delete
    bytes_read: int = 0  # payload bytes verified into host pages
    bytes_written: int = 0  # payload bytes stored
    corrupt: int = 0  # values that failed verification (and were deleted)
    errors: int = 0  # calls (pipelines or single commands) that failed
    unavailable: int = 0  # storage.unavailable events
    reconnected: int = 0  # storage.reconnected events
    full: int = 0  # write pipelines the server refused for memory (OOM, no eviction policy)
    refused_pages: int = 0  # pages not sent while writes backed off from a full server


def is_out_of_memory(reply: Any) -> bool:
    """The server's "OOM command not allowed when used memory > 'maxmemory'" answer (a
    full server under `maxmemory-policy noeviction`), as either parser reports it."""
    return isinstance(reply, Exception) and (
        type(reply).__name__ == "OutOfMemoryError" or str(reply).startswith("OOM ")
    )


def pipelines(sizes: Sequence[int], limit: int) -> list[range]:
    """Consecutive groups of commands of at most `limit` page bytes (a larger page goes alone)."""
    groups: list[range] = []
    start = filled = 0
    for index, size in enumerate(sizes):
        if index > start and filled + size > limit:
            groups.append(range(start, index))
            start, filled = index, 0
        filled += size
    groups.append(range(start, len(sizes)))
    return groups


class RedisCalls:
    """Runs a backend's commands over its link; owns the permits and the reachability state."""

    def __init__(self, spec: RedisSpec, link: RedisLink, counters: Counters, emit: EventSink):
        self.spec = spec
        self.link = link
        self._counters = counters
        self._emit = emit
        # One permit per pooled connection, so a call never waits on the pool (whose wait is a
        # timeout and would turn load into misses) and a cluster node never runs out.
        self.permits = anyio.Semaphore(spec.pool)
        self._reachable = True
        self.gate = WriteGate(time.monotonic)  # closed for a while after an OOM answer

    async def run(
        self,
        op: str,
        commands: Sequence[tuple[Any, ...]],
        sizes: Sequence[int],
        take: Take,
        *,
        targets: Sequence[Target | None] | None = None,
    ) -> None:
        """Run `commands`, cut into pipelines of at most `pipeline_bytes` page bytes (a larger
        page goes alone), the pipelines concurrently, at most `pool` at once. Calls
        `take(index, reply)` as each pipeline's replies arrive; a failed command's reply is its
        exception. With `targets`, the batch goes over the in-place connections
        (RedisLink.read_into): GET replies with a Target land in it; None is a plain reply.
        Never raises for server, connection or timeout failures."""
        groups = pipelines(sizes, self.spec.pipeline_bytes)

        async def one(group: range) -> None:
            async with self.permits:
                try:
                    if targets is None:
                        replies = await self.link.send([commands[i] for i in group])
                    else:
                        replies = await self.link.read_into(
                            [commands[i] for i in group], [targets[i] for i in group]
                        )
                except FAILURES as error:
                    replies = [error] * len(group)
            failure = next(
                (r for r in replies if isinstance(r, BaseException) and not is_wrong_type(r)), None
            )
            if failure is None:
                self.succeeded()
                if op == "set" and self.gate.landed():
                    self._emit("storage.writes_resumed", backend="redis")
            elif op == "set" and is_out_of_memory(failure):
                self.full(failure)
            else:
                self.failed(op, failure)
            for index, reply in zip(group, replies):
                take(index, reply)

        if len(groups) == 1:
            await one(groups[0])
            return
        async with anyio.create_task_group() as task_group:
            for group in groups:
                task_group.start_soon(one, group)

    async def unlink_or_raise(self, keys: list[str]) -> None:
        for reply in await self.link.send(unlinks(keys)):
            if isinstance(reply, BaseException):
                raise reply

    def failed(self, op: str, error: BaseException) -> None:
        self._counters.errors += 1
        message = redact_text(f"{type(error).__name__}: {error}", self.spec.password)
        if not is_unreachable(error):
            self._emit("storage.error", backend="redis", op=op, error=message)
        elif self._reachable:
            self._reachable = False
            self._counters.unavailable += 1
            self._emit(
                "storage.unavailable",
                backend="redis",
                server=self.spec.redacted(),
                op=op,
                error=message,
            )

    def full(self, error: BaseException) -> None:
        """The server is out of memory: writes back off (reads go on), one event a streak."""
        self.succeeded()  # it answered
        self._counters.full += 1
        if self.gate.full():
            self._emit(
                "storage.full",
                backend="redis",
                server=self.spec.redacted(),
                error=redact_text(f"{type(error).__name__}: {error}", self.spec.password),
            )

    def succeeded(self) -> None:
        if not self._reachable:
            self._reachable = True
            self._counters.reconnected += 1
            self._emit("storage.reconnected", backend="redis", server=self.spec.redacted())


async def check_open(spec: RedisSpec, link: RedisLink) -> None:
    """Log in and PING once; raises BackendUnavailable naming the server, never the password.
    Bounded by the spec's timeouts (and a guard over all of them)."""
    guard = 2 * (spec.connect_timeout_s + 3 * spec.timeout_s) * max(1, len(spec.endpoints))
    failure: BaseException | None = None
    try:
        with anyio.fail_after(guard):
            replies = await link.send([("PING",)])
    except (*FAILURES, TimeoutError) as error:
        failure = error
    else:
        if isinstance(replies[0], BaseException):  # an error reply (e.g. NOAUTH, ACL)
            failure = replies[0]
        elif replies[0] not in (True, b"PONG", "PONG"):
            failure = ValueError(f"unexpected PING reply {replies[0]!r}")
    if failure is not None:
        detail = f"{type(failure).__name__}: {failure}" if str(failure) else type(failure).__name__
        if spec.password:
            detail = detail.replace(spec.password, "***")
        raise BackendUnavailable(
            f"redis storage {spec.redacted()} is unreachable or refused this client at open "
            f"({detail}); check the address and the credentials, or pass lazy_connect=true "
            "to open anyway (every call is then a miss until the server answers)"
        ) from None
