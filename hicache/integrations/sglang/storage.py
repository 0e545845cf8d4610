"""`HiCacheL3Storage`: SGLang's `HiCacheStorage` over any hicache storage backend.

SGLang builds it through its dynamic loader as `HiCacheL3Storage(storage_config, kwargs)`,
then hands it the host pool (`register_mem_pool_host`, and for hybrid models each further
pool through `register_mem_host_pool_v2`); the backend for a pool is opened then, since its
namespace needs the pool's geometry. SGLang calls it from its prefetch, prefetch I/O and
backup threads; each call runs on one asyncio loop thread of this object's own, bounded by
`storage_timeout`. Every failure (a missing, corrupt or unreachable value, a store that
raises, a call past its deadline, arguments that do not fit the pool) is a miss or a failed
write, logged and counted, never an exception into SGLang's threads. A read that timed out
returns only once the backend has stopped writing into the host pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from hicache.backends.base import StorageBackend
from hicache.backends.keys import Namespace
from hicache.integrations.sglang.compat import (
    KV_POOL,
    HitPolicy,
    PoolTransferResult,
    StorageBase,
    log,
    storage_metrics,
)
from hicache.integrations.sglang.options import StorageOptions, load_seal, parse_options
from hicache.integrations.sglang.pages import (
    PageMap,
    pool_namespace,
    storage_hash,
    tensor_bytes,
)

T = TypeVar("T")

OPEN_TIMEOUT_S = 60.0
"""Seconds opening a pool's backend (its connect check included) may take."""


class LoopThread:
    """One asyncio loop on a daemon thread: how SGLang's threads call hicache's backends."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """`coro`'s result (or its exception). Past `timeout` (None: none), or once the loop
        is closed, it is cancelled and RuntimeError raised."""
        if self._closed.is_set():
            coro.close()
            raise RuntimeError("the storage loop is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            done, _ = concurrent.futures.wait([future], timeout=wait)
            if done:
                return future.result()
            if self._closed.is_set() or (deadline is not None and time.monotonic() >= deadline):
                future.cancel()
                raise RuntimeError(
                    "the storage call did not finish (loop closed or past its bound)"
                )

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()


@dataclass(slots=True)
class _Pool:
    """One registered host pool: where its pages lie, its namespace and its backend."""

    name: str
    pages: PageMap
    namespace: Namespace
    backend: StorageBackend
    writes: bool  # False on an MLA rank other than SGLang's storage writer: rank 0 stores


@dataclass(slots=True)
class _Counters:
    """What `stats()` reports besides the backends' own counters."""

    pages_read: int = 0  # pages a get found and verified
    pages_missed: int = 0  # pages a get asked for and did not get
    pages_written: int = 0
    pages_not_written: int = 0
    failures: int = 0  # calls that raised or timed out (each answered as misses)
    samples: dict[str, list[Any]] = field(
        default_factory=lambda: {k: [] for k in ("get_pgs", "set_pgs", "get_bw", "set_bw")}
    )


class HiCacheL3Storage(StorageBase):
    """SGLang HiCache storage over a hicache storage spec (docs/sglang.md)."""

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.options: StorageOptions = parse_options(getattr(storage_config, "extra_config", None))
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError(
                "hicache SGLang storage: tp_lcm_size with page_head head splitting is not "
                "supported; leave tp_lcm_size unset (docs/sglang.md)"
            )
        model = self.options.model_id or getattr(storage_config, "model_name", None)
        if not model:
            raise ValueError(
                "hicache SGLang storage: no model name to key pages on: SGLang gave none; "
                "set model_id in the extra config (docs/sglang.md)"
            )
        self.model: str = model
        self.seal = load_seal(self.options)
        self.metrics_enabled = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()
        self._count = _Counters()
        self._loop = LoopThread("hicache-sglang-storage")
        self._closed = False

    # ---------------------------------------------------------------- registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The anchor (KV) host pool: opens its backend; raises if the store cannot be
        opened (SGLang then fails the attach)."""
        self.mem_pool_host = mem_pool_host
        self._register(mem_pool_host, KV_POOL)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool of a hybrid model (KV, Mamba, SWA, ...), keyed by its name."""
        if not hasattr(self, "registered_pools"):
            self.registered_pools: dict[Any, Any] = {}
        self.registered_pools[host_pool_name] = host_pool
        self._register(host_pool, str(getattr(host_pool_name, "value", host_pool_name)))

    def _register(self, pool: Any, name: str) -> None:
        old = self._pools.get(name)
        if old is not None and old.pages.pool is pool:
            return
        from hicache.backends.registry import connect_backend

        pages = PageMap(pool)
        config = self.storage_config
        namespace = pool_namespace(
            pool,
            name,
            config=config,
            model=self.model,
            salt=self.options.salt,
            seal=self.seal,
            page_bytes=pages.page_bytes,
        )
        writes = namespace.attention == "mha" or bool(
            getattr(config, "is_storage_writer", namespace.writes)
        )
        backend = self._loop.run(
            connect_backend(
                self.options.storage,
                namespace=namespace,
                emit=self._emit,
                connect_timeout=OPEN_TIMEOUT_S,
                **dict(self.options.storage_options),
            ),
            OPEN_TIMEOUT_S + 5,
        )
        self._pools[name] = _Pool(name, pages, namespace, backend, writes)
        if old is not None:
            self._close_backend(old.backend)
        log.info(
            "hicache storage %s for pool %s: %s, %d bytes a page, %s",
            self.options.storage,
            name,
            namespace.kv,
            pages.page_bytes,
            "zero-copy" if pages.zero_copy else "copied",
        )

    def _emit(self, event: str, **fields: Any) -> None:
        log.warning("hicache %s %s", event, fields)

    # ---------------------------------------------------------------- the loop

    def _call(self, what: str, coro: Coroutine[Any, Any, int], fallback: int = 0) -> int:
        """Run one backend call; its deadline cancels it, and a cancelled read returns only
        when nothing writes into its targets any more. Any failure is `fallback`."""

        async def bounded() -> int:
            return int(await asyncio.wait_for(coro, self.options.storage_timeout))

        try:
            return self._loop.run(bounded())
        except Exception as exc:  # noqa: BLE001 - every storage failure is a miss (contract)
            with self._lock:
                self._count.failures += 1
            log.warning("hicache storage %s failed (a miss): %r", what, exc)
            return fallback

    def _pool(self, name: str) -> _Pool | None:
        pool = self._pools.get(name)
        if pool is None:
            log.error(
                "hicache storage: no host pool %r registered (registered: %s)",
                name,
                list(self._pools),
            )
        return pool

    # ---------------------------------------------------------------- page I/O

    def _slots(self, pool: _Pool, n: int, host_indices: Any) -> list[int] | None:
        """The first host slot of each of `n` pages, or None (logged) when the indices do
        not hold `n` pages of the pool."""
        size = pool.pages.page_size
        if not isinstance(host_indices, torch.Tensor) or host_indices.numel() < n * size:
            got = host_indices.numel() if isinstance(host_indices, torch.Tensor) else host_indices
            log.error(
                "hicache storage: %d pages of pool %s need %d host indices, got %r",
                n,
                pool.name,
                n * size,
                got,
            )
            return None
        flat = host_indices.reshape(-1)
        return [int(i) for i in flat[: n * size : size].tolist()]

    def _read(self, pool: _Pool, keys: Sequence[str], slots: Sequence[int]) -> int:
        """Read `keys` into the pool's pages at `slots`: the verified leading count."""
        if not keys:
            return 0
        names = pool.namespace.keys([storage_hash(k) for k in keys])
        t0 = time.perf_counter()
        if pool.pages.zero_copy:
            targets = [pool.pages.pieces(s) for s in slots]
            got = self._call("get", pool.backend.get_into(names, targets))
        else:
            scratch = [pool.pages.scratch() for _ in slots]
            got = self._call(
                "get", pool.backend.get_into(names, [[tensor_bytes(t)] for t in scratch])
            )
            try:
                for slot, page in zip(slots[:got], scratch[:got]):
                    pool.pages.copy_in(slot, page)
            except Exception as exc:  # noqa: BLE001 - a page SGLang cannot take is a miss
                log.warning("hicache storage: pool %s refused a page (a miss): %r", pool.name, exc)
                got = 0
        self._record("get", len(keys), got, pool.pages.page_bytes, time.perf_counter() - t0)
        return got

    def _write(self, pool: _Pool, keys: Sequence[str], slots: Sequence[int]) -> int:
        """Store the pool's pages at `slots` under `keys`: the stored leading count."""
        if not keys:
            return 0
        if not pool.writes:
            return len(keys)  # another rank stores the same MLA pages
        names = pool.namespace.keys([storage_hash(k) for k in keys])
        t0 = time.perf_counter()
        if pool.pages.zero_copy:
            sources = [pool.pages.pieces(s) for s in slots]
            kept: list[torch.Tensor] = []
        else:
            kept = [pool.pages.copy_out(s) for s in slots]
            sources = [[tensor_bytes(t)] for t in kept]
        got = self._call("set", pool.backend.set_from(names, sources))
        self._record("set", len(keys), got, pool.pages.page_bytes, time.perf_counter() - t0)
        return got

    def _record(self, op: str, asked: int, got: int, page_bytes: int, seconds: float) -> None:
        with self._lock:
            c = self._count
            if op == "get":
                c.pages_read += got
                c.pages_missed += asked - got
            else:
                c.pages_written += got
                c.pages_not_written += asked - got
            if self.metrics_enabled and seconds > 0:
                c.samples[f"{op}_pgs"].append(asked)
                c.samples[f"{op}_bw"].append(got * page_bytes / seconds / 1e9)

    # ---------------------------------------------------------------- v1 (zero-copy)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Read each key's page into the host pool at `host_indices` (page by page); a
        leading run of True, then False from the first miss."""
        return self._v1("batch_get_v1", self._read, keys, host_indices)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store the host pool's pages at `host_indices` under `keys`."""
        return self._v1("batch_set_v1", self._write, keys, host_indices)

    def _v1(
        self,
        call: str,
        move: Callable[[_Pool, Sequence[str], Sequence[int]], int],
        keys: list[str],
        host_indices: torch.Tensor,
    ) -> list[bool]:
        """One v1 call over the KV pool's pages at `host_indices`: a leading run of True for
        the pages moved; anything that goes wrong is a miss or a failed write."""
        try:
            pool = self._pool(KV_POOL)
            slots = None if pool is None else self._slots(pool, len(keys), host_indices)
            got = 0 if pool is None or slots is None else move(pool, keys, slots)
        except Exception as exc:  # noqa: BLE001 - never raise into SGLang's threads
            log.warning("hicache storage %s failed (misses): %r", call, exc)
            got = 0
        return [i < got for i in range(len(keys))]

    # ---------------------------------------------------------------- legacy calls

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Read each key's flat page into `target_locations` (SGLang's dummy pages): the
        targets of the leading hits, then None."""
        n = len(keys)
        targets = list(target_locations or [])
        if len(targets) != n or not all(
            isinstance(t, torch.Tensor) and t.is_contiguous() for t in targets
        ):
            log.error(
                "hicache storage batch_get: %d keys need %d contiguous page tensors, got %r",
                n,
                n,
                [type(t).__name__ for t in targets],
            )
            return [None] * n
        pool = self._pools.get(KV_POOL)
        if pool is None or n == 0:
            return [None] * n
        names = pool.namespace.keys([storage_hash(k) for k in keys])
        t0 = time.perf_counter()
        got = self._call("get", pool.backend.get_into(names, [[tensor_bytes(t)] for t in targets]))
        self._record("get", n, got, pool.pages.page_bytes, time.perf_counter() - t0)
        return [t if i < got else None for i, t in enumerate(targets)]

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat pages (`get_data_page(index)` of the host pool) under `keys`; True
        when every one is stored."""
        n = len(keys)
        vals = list(values or [])
        if len(vals) != n or not all(isinstance(v, torch.Tensor) for v in vals):
            log.error("hicache storage batch_set: %d keys need %d page tensors", n, n)
            return False
        pool = self._pools.get(KV_POOL)
        if pool is None:
            return False
        if n == 0 or not pool.writes:
            return True
        kept = [v.contiguous() for v in vals]
        names = pool.namespace.keys([storage_hash(k) for k in keys])
        t0 = time.perf_counter()
        got = self._call("set", pool.backend.set_from(names, [[tensor_bytes(t)] for t in kept]))
        self._record("set", n, got, pool.pages.page_bytes, time.perf_counter() - t0)
        return got == n

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        if target_location is None:
            pool = self._pools.get(KV_POOL)
            if pool is None:
                return None
            target_location = pool.pages.scratch()
        return self.batch_get([key], [target_location])[0]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of `keys`, from the first, are stored (SGLang's leading hit run)."""
        pool = self._pools.get(KV_POOL)
        if pool is None or not keys:
            return 0
        return self._exists(pool, keys)

    def _exists(self, pool: _Pool, keys: Sequence[str]) -> int:
        try:
            names = pool.namespace.keys([storage_hash(k) for k in keys])
        except Exception as exc:  # noqa: BLE001 - never raise into SGLang's threads
            log.warning("hicache storage exists failed (a miss): %r", exc)
            return 0
        return self._call("exists", pool.backend.exists(names))

    # ---------------------------------------------------------------- v2 (hybrid pools)

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None
    ) -> Any:
        """The usable prefix across the KV pool and each extra pool's hit policy, as SGLang's
        own file backend computes it: ALL_PAGES pools need every page of the prefix,
        TRAILING_PAGES pools (Mamba, SWA state) the last `len(transfer.keys)` pages of it."""
        try:
            return self._exists_v2(keys, list(pool_transfers or []))
        except Exception as exc:  # noqa: BLE001 - never raise into SGLang's threads
            log.warning("hicache storage batch_exists_v2 failed (a miss): %r", exc)
            return PoolTransferResult(0, {}, [])

    def _present(self, pool: _Pool, keys: Sequence[str]) -> list[bool]:
        """Per key: is it stored (one exists call per key, together on the loop)."""
        names = pool.namespace.keys([storage_hash(k) for k in keys])

        async def each() -> list[bool]:
            counts = await asyncio.gather(
                *(pool.backend.exists([n]) for n in names), return_exceptions=True
            )
            return [c == 1 for c in counts]

        async def bounded() -> list[bool]:
            return await asyncio.wait_for(each(), self.options.storage_timeout)

        try:
            return self._loop.run(bounded())
        except Exception as exc:  # noqa: BLE001 - every storage failure is a miss (contract)
            log.warning("hicache storage exists failed (misses): %r", exc)
            return [False] * len(keys)

    def _exists_v2(self, keys: list[str], transfers: list[Any]) -> Any:
        kv = self._pools.get(KV_POOL)
        kv_pages = 0 if kv is None or not keys else self._exists(kv, keys)
        hits: dict[str, int] = {KV_POOL: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in transfers:
            if not restorable:
                break
            name = str(getattr(transfer.name, "value", transfer.name))
            pool = self._pools.get(name)
            policy = str(getattr(transfer.hit_policy, "value", transfer.hit_policy))
            if pool is None or policy not in (HitPolicy.ALL_PAGES, HitPolicy.TRAILING_PAGES):
                log.warning("hicache storage: pool %s (%s) cannot be probed: a miss", name, policy)
                restorable = []
                break
            if policy == HitPolicy.ALL_PAGES:
                boundary = self._exists(pool, keys[:kv_pages])
                ok = set(range(1, boundary + 1))
            else:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                present = self._present(pool, keys[:kv_pages])
                ok = {p for p in range(1, kv_pages + 1) if all(present[max(0, p - trailing) : p])}
                boundary = max(ok, default=0)
            if boundary:
                hits[name] = boundary
            restorable = [p for p in restorable if p in ok]
        final = restorable[-1] if restorable else 0
        return PoolTransferResult(final, hits, restorable)

    def _io_v2(
        self, transfers: Any, op: Callable[[_Pool, Sequence[str], Sequence[int]], int]
    ) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for transfer in list(transfers or []):
            name = str(getattr(transfer.name, "value", transfer.name))
            keys = list(transfer.keys or [])
            try:
                pool = self._pool(name)
                slots = (
                    None if pool is None else self._slots(pool, len(keys), transfer.host_indices)
                )
                got = 0 if pool is None or slots is None else op(pool, keys, slots)
            except Exception as exc:  # noqa: BLE001 - never raise into SGLang's threads
                log.warning("hicache storage v2 %s failed (misses): %r", name, exc)
                got = 0
            results[transfer.name] = [i < got for i in range(len(keys))]
        return results

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        """Read each transfer's keys into its pool's host slots: per pool, per key."""
        return self._io_v2(transfers, self._read)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        """Store each transfer's pages from its pool's host slots: per pool, per key."""
        return self._io_v2(transfers, self._write)

    # ---------------------------------------------------------------- housekeeping

    def clear(self) -> bool:
        """Remove every value of this backend's namespaces (nothing else on the store)."""
        ok = True
        for pool in list(self._pools.values()):
            if self._call("clear", _clear(pool.backend), fallback=-1) < 0:
                ok = False
        return ok

    def stats(self) -> dict[str, int]:
        """hicache's counters: the backends' summed, and this adapter's page counts."""
        totals: dict[str, int] = {}
        for pool in list(self._pools.values()):
            try:
                for k, v in pool.backend.stats().items():
                    totals[k] = totals.get(k, 0) + int(v)
            except Exception as exc:  # noqa: BLE001 - stats are best effort
                log.warning("hicache storage stats failed: %r", exc)
        with self._lock:
            c = self._count
            totals.update(
                pages_read=c.pages_read,
                pages_missed=c.pages_missed,
                pages_written=c.pages_written,
                pages_not_written=c.pages_not_written,
                failures=c.failures,
            )
        return totals

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` since the last call (pages and GB/s per get and set
        batch) when SGLang enabled storage metrics, else None."""
        if not self.metrics_enabled:
            return None
        with self._lock:
            s = self._count.samples
            taken = {k: list(v) for k, v in s.items()}
            for v in s.values():
                v.clear()
        return storage_metrics(taken["get_pgs"], taken["set_pgs"], taken["get_bw"], taken["set_bw"])

    def _close_backend(self, backend: StorageBackend) -> None:
        try:
            self._loop.run(backend.aclose(), self.options.storage_timeout)
        except Exception as exc:  # noqa: BLE001 - closing is best effort
            log.warning("hicache storage close failed: %r", exc)

    def close(self) -> None:
        """Close every backend and the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for pool in list(self._pools.values()):
            self._close_backend(pool.backend)
        self._pools.clear()
        self._loop.close()


async def _clear(backend: StorageBackend) -> int:
    await backend.clear()
    return 0
