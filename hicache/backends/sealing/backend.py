"""A backend wrapper that seals every value it stores and opens every value it reads.

`seal_backend(backend, namespace)` wraps any `StorageBackend` when the namespace carries a
`Seal` (seal.py), and returns it unchanged otherwise; `registry.open_backend` applies it to
every backend it builds. The wrapped backend stores `[seal block, page pieces]` (tag mode) or
`[seal block, ciphertext]` (encryption) through its own framing and checksum, so every
backend, the shipped ones and out-of-tree ones, gets the same protection unchanged; only the
payload grows by `SEAL_SIZE` bytes.

A read lands the block in a small buffer (and, encrypted, the ciphertext in a scratch page),
then checks the tag (and decrypts into the page's pieces) on worker threads. A value that does
not verify (forged without the secret, altered, written under another secret or mode) is a
miss, a `storage.corrupt` event (`reason`: seal or tag) and is deleted, as the backends do
with a value whose checksum fails. Zero-copy holds for tag mode; encryption copies once each way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hicache.backends.base import (
    EventSink,
    PageBuffer,
    StorageBackend,
    accepts_writes,
    enforces_ttl,
    no_events,
    set_from_ttl,
)
from hicache.backends.batch import check_buffers
from hicache.backends.blocking import BlockingRunner
from hicache.backends.keys import Namespace
from hicache.seal import SEAL_SIZE, Seal, SealError

DEFAULT_THREADS = 2


def seal_backend(
    backend: StorageBackend,
    namespace: Namespace,
    *,
    emit: EventSink | None = None,
    virtual_time: bool = False,
    threads: int | None = None,
) -> StorageBackend:
    """`backend` sealed under `namespace.seal`, or `backend` itself without one (or when it
    is sealed already). `virtual_time` runs the crypto inline (no real threads)."""
    if namespace.seal is None or isinstance(backend, SealedBackend):
        return backend
    if threads is None:
        threads = 0 if virtual_time else DEFAULT_THREADS
    return SealedBackend(backend, namespace=namespace, emit=emit, threads=threads)


class SealedBackend:
    """StorageBackend sealing values for `inner`; see the module docstring."""

    def __init__(
        self,
        inner: StorageBackend,
        *,
        namespace: Namespace,
        emit: EventSink | None = None,
        threads: int = DEFAULT_THREADS,
    ) -> None:
        if namespace.seal is None:
            raise ValueError("SealedBackend needs a namespace with a seal")
        self.inner = inner
        self.namespace = namespace
        self._seal: Seal = namespace.seal
        self._value_key = self._seal.value_key(namespace.digest) if self._seal.encrypt else None
        self._emit = emit or no_events
        self._runner = BlockingRunner(threads)
        self._corrupt = 0  # values the inner backend verified but whose seal failed
        self._dropped = 0  # pages the inner backend counted as hits that this one did not

    def __repr__(self) -> str:
        return f"SealedBackend({self.inner!r}, {self._seal!r})"

    # Optional hooks of the inner backend pass through.
    async def connect(self) -> None:
        connect = getattr(self.inner, "connect", None)
        if callable(connect):
            await connect()

    def attach_host_pool(self, pool: object) -> None:
        attach = getattr(self.inner, "attach_host_pool", None)
        if callable(attach):
            attach(pool)

    async def exists(self, keys: Sequence[str]) -> int:
        return await self.inner.exists(keys)

    @property
    def enforces_ttl(self) -> bool:
        return enforces_ttl(self.inner)

    def accepts_writes(self) -> bool:
        return accepts_writes(self.inner)

    async def set_from(
        self, keys: Sequence[str], sources: Sequence[PageBuffer], *, ttl: float | None = None
    ) -> int:
        pages = check_buffers(self.namespace, keys, sources, writable=False)
        sealed = await self._runner.map(self._seal_one, list(zip(keys, pages)))
        return await set_from_ttl(self.inner, keys, sealed, ttl=ttl)

    async def get_into(self, keys: Sequence[str], targets: Sequence[PageBuffer]) -> int:
        pages = check_buffers(self.namespace, keys, targets, writable=True)
        blocks = [memoryview(bytearray(SEAL_SIZE)) for _ in pages]
        if self._seal.encrypt:  # the ciphertext lands in scratch, then decrypts into the page
            landed = [[memoryview(bytearray(sum(p.nbytes for p in page)))] for page in pages]
        else:
            landed = pages
        inner_targets = [[block, *land] for block, land in zip(blocks, landed)]
        got = await self.inner.get_into(keys, inner_targets)
        if got == 0:
            return 0
        jobs = list(zip(keys[:got], blocks, landed, pages))
        failures = await self._runner.map(self._open_one, jobs)
        bad = [i for i, failure in enumerate(failures) if failure is not None]
        for i in bad:
            failure = failures[i]
            assert failure is not None
            self._corrupt += 1
            self._emit("storage.corrupt", key=keys[i], reason=failure.reason)
        if not bad:
            return got
        await self.inner.delete([keys[i] for i in bad])
        self._dropped += got - bad[0]
        return bad[0]

    async def delete(self, keys: Sequence[str]) -> None:
        await self.inner.delete(keys)

    async def clear(self) -> None:
        await self.inner.clear()

    def stats(self) -> Mapping[str, int | float]:
        out = dict(self.inner.stats())
        out["seal_rejected"] = self._corrupt
        out["corrupt"] = out.get("corrupt", 0) + self._corrupt
        if "get_hits" in out:
            out["get_hits"] -= self._dropped
        return out

    async def aclose(self) -> None:
        await self.inner.aclose()

    # -- worker-thread side: pure computation, no counters, no events ---------------------

    def _seal_one(self, item: tuple[str, list[memoryview]]) -> list[Any]:
        key, pieces = item
        return self._seal.seal(key, pieces, self._value_key)

    def _open_one(
        self, job: tuple[str, memoryview, list[memoryview], list[memoryview]]
    ) -> SealError | None:
        key, block, landed, pieces = job
        try:
            self._seal.open(key, block, landed, pieces, self._value_key)
        except SealError as exc:
            return exc
        return None
