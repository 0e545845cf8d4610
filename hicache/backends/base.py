"""The storage (L3) protocol every backend implements.

A page's bytes live in the host pool as one or more contiguous pieces (one for page-first
layouts, one per layer and K/V for layer-first); a backend reads and writes those pieces in
place (zero-copy), so a `PageBuffer` is the ordered list of pieces whose concatenation is
the page's value. Keys are full L3 keys (namespace included), opaque to the backend.

Failure contract: a backend never raises for a missing, corrupt or unreachable value; it
reports a miss (a shorter count) and leaves an event. Only programming errors raise.

Opening: a backend may have an optional `async def connect(self) -> None`, which
`registry.connect_backend` (hence the cache, at open) awaits once before any other call; it
raises `BackendUnavailable` when the store cannot be reached or refuses the credentials, so a
misconfigured store fails the open instead of turning into a silent 0% hit rate.

Two more optional hooks let a backend own its quirks: `attach_host_pool(pool)`, called once by
the cache that opened it, with the host pool whose pages it will move (Mooncake registers the
buffer for zero-copy transfers); and a class attribute `VIRTUAL_TIME_OPTIONS`, options the
registry fills in when a deterministic (virtual-time) cache opens it (the file store runs its
calls inline there: no real threads on a virtual clock).

Expiry: a backend that can enforce a per-value time-to-live says so with a true attribute
`enforces_ttl` and takes `set_from(keys, sources, *, ttl=None)` (`ExpiringBackend`): `ttl` is
seconds from the write until the values are misses; None never expires; a ttl <= 0 stores
nothing and removes any older value under the key (expired on arrival), and still counts as
stored. Callers go through `set_from_ttl`, which drops the ttl for backends without it (their
values then live until evicted), so `StorageBackend` itself is unchanged for out-of-tree stores.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, cast, runtime_checkable


class BackendUnavailable(ConnectionError):
    """Opening a backend found its store unreachable, or refusing this client (wrong
    credentials, a database it may not use). Raised only at open (`registry.connect_backend`),
    never by the protocol's calls; the message names the store (host:port or socket path,
    never a password)."""


PageBuffer = Sequence[memoryview]
"""The pieces of one page in host memory, in order; each a C-contiguous byte view. The host
pool hands pages out as `hicache.kernels.pools.PagePieces`, a list that may also say
`header_room`, how many bytes right before the first piece a backend may write (read it with
`getattr(page, "header_room", 0)`: other buffers have none)."""

EventSink = Callable[..., None]
"""Where a backend reports its events: `emit(event, **fields)`, the cache's event log."""


def no_events(event: str, **fields: object) -> None:
    """The sink of a backend built without one: its events are dropped."""


@runtime_checkable
class StorageBackend(Protocol):
    """An L3 store of page values keyed by chained page hashes. Methods may be awaited
    concurrently from one event loop; a backend that blocks runs its I/O in worker threads."""

    async def exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are present (stops at the first absent one)."""
        ...

    async def get_into(self, keys: Sequence[str], targets: Sequence[PageBuffer]) -> int:
        """Read each key's value into its target pieces; return how many pages, from the
        first, were read and verified. Pages past the returned count may hold garbage and
        must not be used. Corrupt values count as misses and are deleted."""
        ...

    async def set_from(self, keys: Sequence[str], sources: Sequence[PageBuffer]) -> int:
        """Store each page's pieces under its key; return how many, from the first, are stored."""
        ...

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove keys; absent keys are ignored."""
        ...

    async def clear(self) -> None:
        """Remove every value under this backend's namespace."""
        ...

    def stats(self) -> Mapping[str, int | float]:
        """Counters: at least gets, get_hits, sets, bytes_read, bytes_written, corrupt."""
        ...

    async def aclose(self) -> None:
        """Release connections and threads. Idempotent."""
        ...


class ExpiringBackend(StorageBackend, Protocol):
    """A StorageBackend whose writes may carry a time-to-live (see the module docstring)."""

    enforces_ttl: bool

    async def set_from(
        self, keys: Sequence[str], sources: Sequence[PageBuffer], *, ttl: float | None = None
    ) -> int:
        """As StorageBackend.set_from; with `ttl`, the values are misses `ttl` seconds later."""
        ...


def enforces_ttl(backend: object) -> bool:
    """Whether `backend` makes values written with a ttl expire (Redis, file, memory: yes;
    Mooncake and most out-of-tree stores: no)."""
    return getattr(backend, "enforces_ttl", False) is True


def accepts_writes(backend: object) -> bool:
    """Whether `backend` takes writes now. A store that answered "full" may say no for a
    backoff (`backends/fullness.py`: it has an `accepts_writes()` method); a caller then
    skips the write instead of retrying it. Backends without the method always take them."""
    probe = getattr(backend, "accepts_writes", None)
    return True if probe is None else bool(probe())


def check_ttl(ttl: float | None) -> None:
    """A ttl is None or a finite number of seconds (bool is not a number here)."""
    if ttl is not None and (
        isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl)
    ):
        raise ValueError(f"ttl must be None or a finite number of seconds, got {ttl!r}")


async def set_from_ttl(
    backend: StorageBackend,
    keys: Sequence[str],
    sources: Sequence[PageBuffer],
    *,
    ttl: float | None = None,
) -> int:
    """`backend.set_from(keys, sources)`, passing `ttl` where the backend enforces expiry and
    dropping it elsewhere (values then live until evicted); the stored prefix count."""
    check_ttl(ttl)
    if ttl is None or not enforces_ttl(backend):
        return await backend.set_from(keys, sources)
    return await cast(ExpiringBackend, backend).set_from(keys, sources, ttl=ttl)
