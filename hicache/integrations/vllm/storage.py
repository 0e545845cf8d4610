"""L3 for the synchronous connector: a hicache storage backend behind an asyncio loop thread,
every failure a miss."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from hicache.backends.keys import Namespace
from hicache.integrations.vllm.compat import log
from hicache.integrations.vllm.options import ConnectorOptions

if TYPE_CHECKING:
    from hicache.backends.base import StorageBackend

T = TypeVar("T")


class LoopThread:
    """One asyncio loop on a daemon thread: how the synchronous connector calls hicache's
    async storage backends."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()


class Storage:
    """An L3 backend behind a loop thread; every failure is a miss (hicache's contract)."""

    def __init__(self, spec: str, namespace: Namespace, options: ConnectorOptions) -> None:
        from hicache.backends.registry import connect_backend

        self.namespace = namespace
        self.timeout = options.storage_timeout
        self.errors = 0
        self._loop = LoopThread("hicache-vllm-storage")
        self.backend: StorageBackend = self._loop.run(
            connect_backend(
                spec, namespace=namespace, emit=self._emit, **dict(options.storage_options)
            ),
            max(30.0, self.timeout),
        )

    def _emit(self, event: str, **fields: Any) -> None:
        log.warning("hicache %s %s", event, fields)

    def keys(self, hashes: Sequence[str]) -> list[str]:
        return self.namespace.keys(hashes)

    def exists(self, hashes: Sequence[str]) -> int:
        if not hashes:
            return 0
        try:
            return int(self._loop.run(self.backend.exists(self.keys(hashes)), self.timeout))
        except Exception as exc:  # noqa: BLE001 - any storage failure is a miss (contract)
            self.errors += 1
            log.warning("hicache storage exists failed (a miss): %r", exc)
            return 0

    def read_async(
        self, hashes: Sequence[str], targets: Sequence[Sequence[memoryview]]
    ) -> concurrent.futures.Future[int]:
        """Read `hashes` into `targets` on the loop: a future of how many leading pages
        landed (verified), bounded by `storage_timeout`; every failure is 0, never raised.
        A caller that stops waiting must not read `targets` again: a backend's thread may
        still write into them (so asynchronous loads read into buffers of their own)."""
        keys = self.keys(hashes)

        async def read() -> int:
            try:
                got = await asyncio.wait_for(self.backend.get_into(keys, targets), self.timeout)
                return int(got)
            except Exception as exc:  # noqa: BLE001 - any storage failure is a miss (contract)
                self.errors += 1
                log.warning("hicache storage read failed (a miss): %r", exc)
                return 0

        return self._loop.submit(read())

    def set_from_async(
        self, hashes: Sequence[str], sources: Sequence[Sequence[memoryview]]
    ) -> concurrent.futures.Future[int]:
        return self._loop.submit(self.backend.set_from(self.keys(hashes), sources))

    def close(self) -> None:
        try:
            self._loop.run(self.backend.aclose(), self.timeout)
        except Exception as exc:  # noqa: BLE001 - any storage failure is a miss (contract)
            log.warning("hicache storage close failed: %r", exc)
        self._loop.close()
