"""Mooncake Store as the L3 tier: zero-copy scatter-gather puts and gets from registered host
memory, one client call per chunk of pages, run in worker threads.

    backend = MooncakeBackend.from_spec("mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata",
                                        namespace=ns, emit=emit)
    backend.register_host_memory(pool_ptr, pool_nbytes)   # once, before traffic

Values carry the framing header, written beside the payload (see io.py). Failures are
misses plus events, never exceptions: `storage.corrupt` (key, reason; the value is deleted),
`storage.error` (op, key, code: a per-key client error), `storage.unreachable` (op, code,
retry_in: the master or a peer did not answer; for `retry` seconds afterwards every call
answers a miss at once instead of waiting on the network again).
"""

from __future__ import annotations

import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import anyio
import anyio.to_thread

from hicache.backends.base import BackendUnavailable, EventSink, PageBuffer
from hicache.backends.batch import check_buffers, check_keys
from hicache.backends.batch_checksums import native_checksums
from hicache.backends.fullness import WriteGate
from hicache.backends.mooncake.io import (
    ChunkResult,
    get_chunk,
    is_no_space,
    is_unreachable,
    page_plan,
    put_chunk,
    split_chunks,
)
from hicache.backends.mooncake.memory import Arena, Lane
from hicache.backends.mooncake.spec import MooncakeSpec, parse_spec
from hicache.backends.registered import RegisteredRegions

_T = TypeVar("_T")

if TYPE_CHECKING:
    from hicache.backends.keys import Namespace
    from hicache.kernels.pools import HostPool

ClientFactory = Callable[[MooncakeSpec], Any]
_CONNECT_FAILED = -900  # reported as an RPC failure: the master could not be reached


def _noop(*_args: object, **_fields: object) -> None:
    return None


def connect_client(spec: MooncakeSpec) -> Any:
    """A set-up `MooncakeDistributedStore`; raises ConnectionError when setup fails.

    The TCP transport binds to the address in MC_TCP_BIND_ADDRESS; when unset, it is set to
    this client's address so a loopback deployment stays on loopback."""
    from mooncake.store import MooncakeDistributedStore  # optional dependency

    # The client's setup holds the GIL and retries for about 90 s against an absent master,
    # freezing the whole process: refuse quickly when the endpoints do not even accept.
    endpoints = [(spec.master_host, spec.master_port)]
    meta = urlsplit(spec.metadata)
    if meta.scheme in ("http", "https") and meta.hostname:
        endpoints.append((meta.hostname, meta.port or (443 if meta.scheme == "https" else 80)))
    for host, port in endpoints:
        socket.create_connection((host, port), timeout=spec.probe_timeout).close()
    local = spec.local_address()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", local)
    client = MooncakeDistributedStore()
    rc = client.setup(
        local,
        spec.metadata,
        spec.segment,
        spec.local_buffer,
        spec.protocol,
        spec.device,
        spec.master,
    )
    if rc != 0:
        raise ConnectionError(f"Mooncake setup against master {spec.master} failed with code {rc}")
    return client


class MooncakeBackend:
    """A `StorageBackend` over one Mooncake Store client. Connects in `connect()` (the cache
    awaits it at open), or else lazily on first use (in a worker thread), so construction
    never blocks. Safe for concurrent awaits from one loop;
    at most `spec.lanes` client calls run at once, each with its own registered lane."""

    def __init__(
        self,
        spec: MooncakeSpec,
        *,
        namespace: Namespace,
        emit: EventSink | None = None,
        client_factory: ClientFactory = connect_client,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self.namespace = namespace
        self._emit = emit if emit is not None else _noop
        self._factory = client_factory
        self._clock = clock
        self._client: Any = None
        self._arena: Arena | None = None
        self._lock = threading.Lock()  # guards connecting and registering
        self._wanted: list[tuple[int, int]] = []  # host memory to register, in request order
        self._regions = RegisteredRegions()  # memory the client has accepted
        self._lanes: queue.SimpleQueue[Lane] = queue.SimpleQueue()
        self._limiter = anyio.CapacityLimiter(spec.lanes)
        self._down_until = float("-inf")
        self._closed = False
        self._gate = WriteGate(time.monotonic)  # closed for a while after a "no space" answer
        self._stats: dict[str, int] = dict.fromkeys(
            (
                "full",
                "refused_pages",
                "gets",
                "get_hits",
                "sets",
                "set_pages",
                "bytes_read",
                "bytes_written",
                "corrupt",
                "staged_pages",
                "errors",
                "unreachable",
                "skipped",
            ),
            0,
        )

    @classmethod
    def from_spec(
        cls, spec: str, *, namespace: Namespace, emit: EventSink | None = None, **options: object
    ) -> MooncakeBackend:
        """Validate `spec` (mooncake://MASTER_HOST:PORT?…, see spec.py) and build a
        backend; keyword options override the query. Raises ValueError; connects later."""
        if not isinstance(getattr(namespace, "prefix", None), str):
            raise ValueError(
                f"namespace must be a hicache.backends.keys.Namespace, got {namespace!r}"
            )
        return cls(parse_spec(spec, options), namespace=namespace, emit=emit)

    async def connect(self) -> None:
        """The open-time check (base.py): set the client up now, in a worker thread, so that
        a missing client library or an unreachable master fails the open with
        `BackendUnavailable` instead of every later call answering a miss."""
        where = f"Mooncake master {self.spec.master}"
        try:
            await anyio.to_thread.run_sync(self._ready_client)
        except ImportError as exc:
            raise BackendUnavailable(
                f"{where}: the Mooncake client is not installed ({exc}); "
                "pip install mooncake-transfer-engine (or -non-cuda)"
            ) from None
        except (ConnectionError, OSError) as exc:
            raise BackendUnavailable(f"{where} unreachable: {exc}") from None

    def attach_host_pool(self, pool: HostPool) -> None:
        """The cache that owns this backend hands it its host pool: register the pool's buffer
        so pages move zero-copy. The pool outlives the backend (the cache closes it last)."""
        self.register_host_memory(pool.buffer.data_ptr(), pool.nbytes)

    def register_host_memory(self, ptr: int, nbytes: int) -> None:
        """Let pieces inside [ptr, ptr+nbytes) move zero-copy. Call once per host pool buffer
        before traffic; the memory must outlive the backend. Registration with the client
        happens before the next operation; a region the client refuses is reported as
        `storage.error` and its pages go through staging. Mutates the wanted set only."""
        probe = RegisteredRegions()
        probe.add(ptr, nbytes)  # validates
        with self._lock:
            for p, n in self._wanted:
                if p < ptr + nbytes and ptr < p + n and not (p <= ptr and ptr + nbytes <= p + n):
                    raise ValueError(
                        f"region [{ptr:#x}, +{nbytes}) partly overlaps a registered one"
                    )
            self._wanted.append((ptr, nbytes))

    # ---- worker-thread side -------------------------------------------------------------

    def _ready_client(self) -> Any:
        """Connect if needed and register pending memory. Runs in a worker thread."""
        with self._lock:
            if self._client is None:
                client = self._factory(self.spec)
                arena = Arena(
                    lanes=self.spec.lanes, batch=self.spec.batch, staging=self.spec.staging
                )
                rc = client.register_buffer(arena.ptr, arena.nbytes)
                if rc != 0:
                    raise ConnectionError(
                        f"Mooncake refused to register the staging arena: code {rc}"
                    )
                self._client, self._arena = client, arena
                native_checksums()  # the batch checksum built (once per machine) here, not in a batch
                for lane in arena.lanes:
                    self._lanes.put(lane)
            for ptr, nbytes in self._wanted:
                if self._regions.covers(ptr, nbytes):
                    continue
                rc = self._client.register_buffer(ptr, nbytes)
                if rc == 0:
                    self._regions.add(ptr, nbytes)
                else:
                    self._emit("storage.error", op="register", key=f"{ptr:#x}+{nbytes}", code=rc)
                    self._wanted.remove((ptr, nbytes))
                    break  # list changed; the rest register on the next call
            return self._client

    def _with_lane(self, fn: Callable[[Any, Lane], _T]) -> Callable[[], _T]:
        def run() -> _T:
            client = self._ready_client()
            lane = self._lanes.get_nowait()  # never empty: the limiter admits `lanes` threads
            try:
                return fn(client, lane)
            finally:
                self._lanes.put(lane)

        return run

    # ---- event-loop side ----------------------------------------------------------------

    def _available(self, op: str) -> bool:
        if self._closed:
            raise RuntimeError("MooncakeBackend used after aclose()")
        if self._clock() < self._down_until:
            self._stats["skipped"] += 1
            return False
        return True

    def _unreachable(self, op: str, code: int, detail: str = "") -> None:
        self._down_until = self._clock() + self.spec.retry
        self._stats["unreachable"] += 1
        self._emit("storage.unreachable", op=op, code=code, retry_in=self.spec.retry, detail=detail)

    async def _run(self, op: str, fn: Callable[[], Any], *, abandon: bool = False) -> Any:
        """Run `fn` in a worker thread; None when the store could not be reached (reported).
        Only probes are abandoned on timeout: gets and sets touch the caller's memory, so
        they always run to the client's own timeout before the memory is handed back."""
        try:
            if abandon:
                with anyio.move_on_after(self.spec.probe_timeout):
                    return await anyio.to_thread.run_sync(fn, abandon_on_cancel=True)
                self._unreachable(op, _CONNECT_FAILED, f"no answer in {self.spec.probe_timeout}s")
                return None
            return await anyio.to_thread.run_sync(fn, limiter=self._limiter)
        except (ConnectionError, OSError) as exc:
            self._unreachable(op, _CONNECT_FAILED, str(exc))
            return None

    def _report(self, op: str, result: ChunkResult) -> None:
        for key, reason in result.corrupt:
            self._stats["corrupt"] += 1
            self._emit("storage.corrupt", key=key, reason=reason)
        for key, code in result.errors:
            if is_unreachable(code):
                self._unreachable(op, code)
                break
            if op == "set" and is_no_space(code):
                # The segments are full: one condition, not an error per page. Writes back
                # off while the master's own eviction makes room; reads go on.
                self._stats["full"] += 1
                if self._gate.full():
                    self._emit("storage.full", backend="mooncake", key=key, code=code)
                break
            self._stats["errors"] += 1
            self._emit("storage.error", op=op, key=key, code=code)
        self._stats["staged_pages"] += result.staged

    async def exists(self, keys: Sequence[str]) -> int:
        keys = self._check_keys(keys)
        if not keys or not self._available("exists"):
            return 0

        def probe() -> list[int]:
            return list(self._ready_client().batch_is_exist(keys))

        codes = await self._run("exists", probe, abandon=True)
        if codes is None:
            return 0
        count = 0
        for code in codes:
            if code != 1:
                if code < 0:
                    self._report("exists", ChunkResult(errors=[(keys[count], int(code))]))
                break
            count += 1
        return count

    async def get_into(self, keys: Sequence[str], targets: Sequence[PageBuffer]) -> int:
        return await self._transfer("get", keys, targets)

    async def set_from(self, keys: Sequence[str], sources: Sequence[PageBuffer]) -> int:
        return await self._transfer("set", keys, sources)

    async def _transfer(self, op: str, keys: Sequence[str], pages: Sequence[PageBuffer]) -> int:
        keys = self._check_keys(keys)
        # Validation only: the pages go on as given (host pool pages carry their header room).
        check_buffers(self.namespace, keys, pages, writable=op == "get")
        self._stats["gets" if op == "get" else "sets"] += len(keys)  # pages asked for
        if not keys or not self._available(op):
            return 0
        if op == "set" and not self._gate.is_open():
            self._stats["refused_pages"] += len(keys)
            return 0
        chunk_fn = get_chunk if op == "get" else put_chunk

        def work(client: Any, lane: Lane) -> tuple[list[ChunkResult], Exception | None]:
            # One worker-thread call for the whole batch (plan and every chunk): thread hops
            # cost more than planning. Chunks run one after another: on few cores, concurrent
            # transfers of one batch measured slower, and after a short chunk the rest are useless.
            plans = [page_plan(self._regions, page) for page in pages]
            chunks = split_chunks(
                [sum(p[1]) for p in plans],
                [p[2] for p in plans],
                batch=self.spec.batch,
                staging=self.spec.staging // self.spec.lanes,
            )
            results: list[ChunkResult] = []
            for chunk in chunks:
                try:
                    result = chunk_fn(
                        client,
                        lane,
                        self._regions,
                        keys[chunk.start : chunk.stop],
                        pages[chunk.start : chunk.stop],
                    )
                except (ConnectionError, OSError) as exc:
                    return results, exc
                results.append(result)
                if result.done < len(chunk):
                    break
            return results, None

        outcome = await self._run(op, self._with_lane(work))
        if outcome is None:
            return 0
        results, failure = outcome
        done = 0
        for result in results:
            self._report(op, result)
            done += result.done
            if op == "get":
                self._stats["get_hits"] += result.done
                self._stats["bytes_read"] += result.nbytes
            else:
                self._stats["set_pages"] += result.done
                self._stats["bytes_written"] += result.nbytes
                if result.done and not result.errors and self._gate.landed():
                    self._emit("storage.writes_resumed", backend="mooncake")
        if failure is not None:
            self._unreachable(op, _CONNECT_FAILED, str(failure))
        return done

    async def delete(self, keys: Sequence[str]) -> None:
        keys = self._check_keys(keys)
        if keys and self._available("delete"):
            await self._run("delete", lambda: self._ready_client().batch_remove(keys, True))

    async def clear(self) -> None:
        """Remove every value whose key starts with the namespace prefix (leases ignored)."""
        if self._available("clear"):
            pattern = "^" + re.escape(self.namespace.prefix)
            await self._run("clear", lambda: self._ready_client().remove_by_regex(pattern, True))

    def stats(self) -> Mapping[str, int | float]:
        return dict(self._stats)

    def accepts_writes(self) -> bool:
        """False for a backoff after the store answered it has no space (reads go on)."""
        return self._gate.is_open()

    def _check_keys(self, keys: Sequence[str]) -> list[str]:
        """The keys as a list; each must be a key of this namespace (a caller's bug otherwise)."""
        check_keys(self.namespace, keys)
        return list(keys)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(client.close)
