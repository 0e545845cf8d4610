"""`nixl:DIR`: page values in files, moved by a NIXL agent (NVIDIA's Inference Xfer Library).

Values are the standard framed values (framing.py: header, then the page), one file per page at
the file store's paths (`DIR/<digest>/<h[0:2]>/<h[2]>/<h>`), so a directory written here reads
the same with `file:DIR` and back. What NIXL adds is the data path: a batch moves as NIXL
transfers of DRAM descriptors (each page's pieces, and on reads its header slot) to FILE
descriptors (each file at its offsets) through a storage plugin: POSIX (pread/pwrite, libaio
or io_uring) by default, GDS / GDS_MT (cuFile) where a GPU and its driver are present. Nothing
is copied: the host pool is registered with the agent once (`attach_host_pool`), and reads land
headers in slabs registered once and reused; pieces elsewhere (a test's buffers, the sealing
layer's blocks) are registered for their batch.

A batch moves in `TRANSFER_PARTS` transfers of whole pages, one after another. NIXL's Python
binding holds the GIL while its plugin copies, so each landed part's checksums run on a thread
of the file store's compiled module that never takes the GIL (batch_checksums.checksums_started)
while the next part moves; without that module, one transfer, then `batch_checksums.checksums`.
Writes go to temporary files in `DIR/<digest>/tmp/`; once a page's part landed and its checksum
is known its header is written (`pwrite`) and the file is renamed into place, so readers never
see part of a value and the parts before a failed one are stored. Reads open the present files,
move them, then check the headers and the CRC-32s where the bytes landed: a value that fails is
a miss, a `storage.corrupt` event, and its file is deleted. `exists` stats the files. There is
no size cap and no expiry: values stay until `delete` or `clear`, so give the store a directory
(or a filesystem) sized for it.

Every transfer runs in a worker thread and is bounded by `timeout` seconds: past it the
transfer is released (NIXL aborts it) and the batch is a miss. A call cancelled at the cache's
deadline waits for its thread (the transfer writes into the caller's pages until it returns).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import anyio
import numpy as np

from hicache.backends.base import BackendUnavailable, EventSink
from hicache.backends.batch_checksums import (
    PendingChecksums,
    checksums,
    checksums_started,
    native_checksums,
)
from hicache.backends.framing import CorruptValue, decode_header, pack_header
from hicache.backends.keys import Namespace
from hicache.backends.page_files import (
    PageFileBackend,
    ReadResult,
    WriteResult,
    create_temp,
    os_error,
    place,
    size_mismatch,
    unlink_all,
)
from hicache.backends.registered import RegisteredRegions, address_of
from hicache.backends.spec_options import flag, integer, number, split_dir_spec

FILE_PLUGINS = ("POSIX", "GDS", "GDS_MT")
"""NIXL plugins that move memory to and from files; the backend runs over any of them."""

POSIX_QUEUES = ("use_aio", "use_uring", "use_posix_aio")
"""The POSIX plugin's I/O queue choices. Without one in the spec the backend picks Linux AIO
(`use_aio`): one `io_submit` per batch instead of a system call per descriptor, which measured
2.6x faster than the plugin's own default on the replay (docs/benchmarks.md)."""

TRANSFER_PARTS = 4
"""A batch moves in this many transfers of whole pages, so that the checksums of a part that
landed run, on a native thread, while the next part moves: only the last (shorter) part's are
left after the transfers, and the caller computes those with that thread (docs/benchmarks.md)."""

_OPTIONS = frozenset({"plugin", "threads", "timeout", "fsync"})
_agent_ids = itertools.count()


def load_nixl() -> ModuleType:
    """NIXL's Python API module: the `nixl` meta package's, or a CUDA build's own
    (`nixl_cu12`, `nixl_cu13`). Raises ImportError saying how to install it."""
    import importlib

    errors = []
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:  # absent, or the meta package without a build
            errors.append(f"{name}: {exc}")
    raise ImportError(
        "the nixl backend needs NIXL (pip install 'hicache[nixl]', i.e. nixl-cu12): "
        + "; ".join(errors)
    )


def nixl_missing() -> str | None:
    """Why NIXL cannot be used here, or None."""
    try:
        load_nixl()
    except ImportError as exc:
        return str(exc)
    return None


@dataclass(frozen=True, slots=True)
class NixlSpec:
    """A parsed `nixl:DIR[?option=value&...]` spec."""

    root: str
    plugin: str = "POSIX"
    threads: int = 2
    timeout: float = 30.0
    fsync: bool = False
    params: tuple[tuple[str, str], ...] = ()  # the plugin's own init parameters

    @classmethod
    def parse(cls, spec: str, **options: Any) -> NixlSpec:
        """Spec options in the query, overridden by keywords. Raises ValueError naming the
        option, TypeError for an unknown keyword."""
        split = split_dir_spec(
            spec,
            "nixl",
            known=_OPTIONS,
            options=options,
            example="nixl:/var/cache/hicache",
            passthrough="param.",  # the plugin's: nixl:DIR?param.use_uring=true
            keyword_only=("params",),  # the same as a dict: params={"use_uring": "true"}
        )
        root, values = split.root, split.values
        params = {**split.passed, **(values.pop("params", None) or {})}
        plugin = str(values.get("plugin", "POSIX")).upper()
        if plugin == "POSIX" and not any(q in params for q in POSIX_QUEUES):
            params["use_aio"] = "true"
        if plugin not in FILE_PLUGINS:
            raise ValueError(
                f"nixl spec {spec!r}: plugin {plugin!r} is not a file plugin; "
                f"this backend runs over {', '.join(FILE_PLUGINS)}"
            )
        return cls(
            root=root,
            plugin=plugin,
            threads=integer(values.get("threads", 2), "nixl option threads", lo=1),
            timeout=number(values.get("timeout", 30.0), "nixl option timeout", lo=0, open_lo=True),
            fsync=flag(values.get("fsync", False), "nixl option fsync"),
            params=tuple(sorted((str(k), str(v)) for k, v in params.items())),
        )


class NixlBackend(PageFileBackend):
    """StorageBackend over files through a NIXL agent; see the module docstring. Owns its agent,
    its counters and its temporary files."""

    def __init__(
        self, spec: NixlSpec, *, namespace: Namespace, emit: EventSink | None = None
    ) -> None:
        super().__init__(spec.root, spec.threads, namespace=namespace, emit=emit)
        self.spec = spec
        self._regions = RegisteredRegions()  # host memory registered once (attach_host_pool)
        self._pending_regions: list[tuple[int, int]] = []
        self._lock = threading.Lock()  # the agent, its registrations, the header slabs
        self._agent: Any = None
        # Registered buffers that reads land headers in, free between batches: at most one
        # per batch in flight (`threads`), so a read's DRAM is all registered already.
        self._header_slabs: list[tuple[np.ndarray, Any]] = []
        self._api: ModuleType | None = None

    def __repr__(self) -> str:
        return f"NixlBackend({self.root!r}, plugin={self.spec.plugin})"

    @classmethod
    def from_spec(
        cls, spec: str, *, namespace: Namespace, emit: EventSink | None = None, **options: Any
    ) -> NixlBackend:
        """Spec `nixl:DIR[?plugin=POSIX&threads=2&timeout=30&fsync=no&param.NAME=V]`."""
        return cls(NixlSpec.parse(spec, **options), namespace=namespace, emit=emit)

    # -- opening --------------------------------------------------------------------------

    async def connect(self) -> None:
        """Create the agent and its plugin, and the directory. BackendUnavailable when NIXL
        is missing, the plugin cannot start here, or the directory cannot be made."""
        try:
            await anyio.to_thread.run_sync(self._ready)
        except (ImportError, OSError, RuntimeError, ValueError) as exc:
            raise BackendUnavailable(
                f"nixl store {self.root!r} (plugin {self.spec.plugin}) cannot open: {exc}"
            ) from exc

    def attach_host_pool(self, pool: Any) -> None:
        """Register the host pool's buffer with the agent (before the next transfer), so its
        pages move without a per-batch registration. The pool outlives the backend."""
        self.register_host_memory(pool.buffer.data_ptr(), pool.nbytes)

    def register_host_memory(self, ptr: int, nbytes: int) -> None:
        """Let pieces inside [ptr, ptr+nbytes) move without a per-batch registration."""
        with self._lock:
            if self._regions.add(ptr, nbytes):
                self._pending_regions.append((ptr, nbytes))

    def _ready(self) -> Any:
        """The agent, made on first use, with pending host regions registered. Worker thread."""
        with self._lock:
            if self._agent is None:
                api = load_nixl()
                os.makedirs(self.root, mode=0o700, exist_ok=True)
                config = api.nixl_agent_config(
                    backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
                )
                agent = api.nixl_agent(f"hicache-{os.getpid()}-{next(_agent_ids)}", config)
                if self.spec.plugin not in agent.get_plugin_list():
                    raise RuntimeError(f"NIXL has no {self.spec.plugin} plugin here")
                try:
                    agent.create_backend(self.spec.plugin, dict(self.spec.params))
                except Exception as exc:  # NIXL raises its own error types
                    raise RuntimeError(f"NIXL could not start {self.spec.plugin}: {exc}") from exc
                self._api, self._agent = api, agent
                native_checksums()  # built (once per machine) here rather than in a batch
            for ptr, nbytes in self._pending_regions:
                self._agent.register_memory([(ptr, nbytes, 0, "")], "DRAM")
            self._pending_regions.clear()
            return self._agent

    def _release(self) -> None:
        """Drop the agent (once the batches in flight, whose transfers use it, are done), then
        the header slabs registered with it."""
        with self._lock:
            self._agent = None
            self._header_slabs.clear()

    def _take_header_slab(self, agent: Any, nbytes: int) -> tuple[np.ndarray, Any]:
        """A free registered slab of at least `nbytes` (give it back with `_give_header_slab`).
        None fitting: the largest free one is replaced by a new one (registered once)."""
        with self._lock:
            slabs = self._header_slabs
            for i, (slab, _) in enumerate(slabs):
                if slab.nbytes >= nbytes:
                    return slabs.pop(i)
            if slabs:
                _, old = slabs.pop(max(range(len(slabs)), key=lambda j: slabs[j][0].nbytes))
                with contextlib.suppress(Exception):
                    agent.deregister_memory(old)
            slab = np.empty(max(nbytes, 64 * self._header_size), dtype=np.uint8)
            reg = agent.register_memory([(_array_address(slab), slab.nbytes, 0, "")], "DRAM")
            return slab, reg

    def _give_header_slab(self, agent: Any, held: tuple[np.ndarray, Any]) -> None:
        with self._lock:
            if self._agent is agent:  # else released meanwhile: its registrations went with it
                self._header_slabs.append(held)

    # -- worker-thread side: files and transfers; no counters, no events ------------------

    @contextlib.contextmanager
    def _registered(
        self, agent: Any, dram: list[tuple[int, int, int]], files: list[tuple[int, int]]
    ) -> Iterator[None]:
        """The files `(fd, length)`, and the DRAM of descriptors `dram` that lies outside the
        registered regions, registered with the agent for the duration."""
        loose = _loose(self._regions, dram)
        registered = []
        try:
            with self._lock:
                if loose:
                    registered.append(
                        agent.register_memory([(p, n, 0, "") for p, n in loose], "DRAM")
                    )
                registered.append(
                    agent.register_memory([(0, n, fd, "") for fd, n in files], "FILE")
                )
            yield
        finally:
            with self._lock:
                for reg in registered:
                    with contextlib.suppress(Exception):
                        agent.deregister_memory(reg)

    def _move(
        self,
        agent: Any,
        op: str,
        local: list[tuple[int, int, int]],
        remote: list[tuple[int, int, int]],
        deadline: float,
    ) -> str | None:
        """One NIXL transfer of `local` DRAM descriptors to/from `remote` FILE descriptors
        (offset, length, fd), all registered, given up at `deadline` (monotonic). None when
        done, else the failure."""
        handle = None
        try:
            handle = agent.initialize_xfer(
                op,
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, "FILE"),
                agent.name,
            )
            state = agent.transfer(handle)
            polls = 0
            while state == "PROC":
                polls += 1
                if polls % 256 == 0:  # a long transfer: stop spinning, let others run
                    if time.monotonic() > deadline:
                        return f"transfer not done after {self.spec.timeout}s"
                    time.sleep(0)
                state = agent.check_xfer_state(handle)
            return None if state == "DONE" else f"NIXL transfer state {state}"
        except Exception as exc:  # noqa: BLE001 - NIXL's errors are a failed batch
            return f"{type(exc).__name__}: {exc}"
        finally:
            if handle is not None:
                with contextlib.suppress(Exception):  # releasing also aborts a late transfer
                    agent.release_xfer_handle(handle)

    def _move_pages(
        self,
        op: str,
        files: list[tuple[int, int]],
        descs: _PageDescs,
        pages: list[list[memoryview]],
        header_slots: int | None = None,
    ) -> tuple[list[int], str | None]:
        """Move the pages of `files` (page i: its descriptors in `descs`, and on reads its header
        into slot i of the registered slab at `header_slots`) in `TRANSFER_PARTS` transfers of
        whole pages, one after another, each landed part's checksums started on a native
        thread while the next part moves (NIXL holds the GIL meanwhile). Without the compiled
        module: one transfer, then `checksums` (the pool's threads would wait for the GIL
        during it). Returns the CRC-32s of the pages that landed, a prefix, and the failure
        that ended the rest (None when all landed). Each transfer is bounded by `timeout`."""
        agent = self._ready()
        deadline = time.monotonic() + self.spec.timeout
        hsize = self._header_size
        split = native_checksums() is not None
        pending: list[PendingChecksums] = []
        crcs: list[int] = []
        failure = None
        try:
            with self._registered(agent, descs.local, files):
                for lo, hi in _parts(len(files), TRANSFER_PARTS if split else 1):
                    local: list[tuple[int, int, int]] = []
                    remote: list[tuple[int, int, int]] = []
                    if header_slots is not None:
                        local = [(header_slots + i * hsize, hsize, 0) for i in range(lo, hi)]
                        remote = [(0, hsize, files[i][0]) for i in range(lo, hi)]
                    local += descs.local[descs.starts[lo] : descs.starts[hi]]
                    remote += descs.remote[descs.starts[lo] : descs.starts[hi]]
                    failure = self._move(agent, op, local, remote, deadline)
                    if failure is not None:
                        break
                    if split:
                        pending.append(checksums_started(pages[lo:hi]))
                    else:
                        crcs = checksums(pages[lo:hi])
        except Exception as exc:  # noqa: BLE001 - a failed registration is a failed batch
            failure = f"{type(exc).__name__}: {exc}"
        finally:  # the threads read the pages: done before the pages go back to the caller
            crcs = [crc for part in pending for crc in part.result()] + crcs
        return crcs, failure

    def _write_pages(
        self, keys: list[str], paths: list[str], pages: list[list[memoryview]]
    ) -> WriteResult:
        # Each page's header is written once its part landed and its checksum is known,
        # then its file is renamed into place: the pages of the parts before a failed one
        # are stored.
        hsize = self._header_size
        opened: list[tuple[str, int]] = []  # (temporary path, fd), per page
        errors: list[tuple[str, str]] = []
        descs = _PageDescs()
        files: list[tuple[int, int]] = []
        oks = [False] * len(keys)
        try:
            for key, pieces in zip(keys, pages):
                try:
                    tmp = self._temp_path()
                    fd = create_temp(tmp)
                except OSError as exc:
                    errors.append((key, os_error(exc)))
                    break
                opened.append((tmp, fd))
                files.append((fd, descs.add(pieces, fd, hsize)))
            if not files:
                return oks, errors
            crcs, failure = self._move_pages("WRITE", files, descs, pages)
            if failure is not None:
                errors.insert(0, (keys[len(crcs)], failure))
            for i, crc in enumerate(crcs):
                tmp, fd = opened[i]
                try:
                    os.pwrite(fd, pack_header(keys[i], files[i][1] - hsize, crc), 0)
                    if self.spec.fsync:
                        os.fsync(fd)
                    place(tmp, paths[i])
                    oks[i] = True
                except OSError as exc:
                    errors.append((keys[i], os_error(exc)))
            return oks, errors
        finally:
            for (tmp, fd), placed in zip(opened, oks):
                os.close(fd)
                if not placed:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)

    def _read_pages(
        self, keys: list[str], paths: list[str], pages: list[list[memoryview]]
    ) -> ReadResult:
        result = ReadResult(ok=[False] * len(keys), corrupt=[], errors=[])
        hsize = self._header_size
        agent = self._ready()
        slab = self._take_header_slab(agent, len(keys) * hsize)
        headers = slab[0]
        fds: list[int] = []
        descs = _PageDescs()
        files: list[tuple[int, int]] = []
        try:
            # Only the present prefix is read: a miss ends what the count can report.
            wants = [sum(p.nbytes for p in pieces) for pieces in pages]
            for key, path, pieces, want in zip(keys, paths, pages, wants):
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    break
                except OSError as exc:
                    result.errors.append((key, os_error(exc)))
                    break
                fds.append(fd)
                size = os.fstat(fd).st_size
                if size != hsize + want:
                    result.corrupt.append((key, size_mismatch(fd, key, size, want)))
                    unlink_all([path])
                    break
                descs.add(pieces, fd, hsize)
                files.append((fd, size))
            if not files:
                return result
            crcs, failure = self._move_pages(
                "READ", files, descs, pages, header_slots=_array_address(headers)
            )
            if failure is not None:
                result.errors.append((keys[len(crcs)], failure))
            for i, crc in enumerate(crcs):
                try:
                    header = decode_header(headers[i * hsize : (i + 1) * hsize].data, keys[i])
                    if header.payload_len != wants[i]:
                        raise CorruptValue("truncated", "header and file size disagree")
                    if header.crc32 != crc:
                        raise CorruptValue("checksum", f"checksum mismatch for {keys[i]!r}")
                except CorruptValue as exc:
                    result.corrupt.append((keys[i], exc.reason))
                    unlink_all([paths[i]])
                    continue
                result.ok[i] = True
            return result
        finally:
            self._give_header_slab(agent, slab)
            for fd in fds:
                os.close(fd)


class _PageDescs:
    """A batch's DRAM and FILE descriptors, page by page: page i's are
    `local[starts[i]:starts[i + 1]]` and `remote[...]` (the same range)."""

    __slots__ = ("local", "remote", "starts")

    def __init__(self) -> None:
        self.local: list[tuple[int, int, int]] = []
        self.remote: list[tuple[int, int, int]] = []
        self.starts = [0]

    def add(self, pieces: list[memoryview], fd: int, offset: int) -> int:
        """The descriptors that move `pieces` to or from consecutive offsets of file `fd` from
        `offset`, as the next page; returns the offset after the last."""
        local, remote = self.local, self.remote
        for piece in pieces:
            n = piece.nbytes
            if n:
                local.append((address_of(piece), n, 0))
                remote.append((offset, n, fd))
                offset += n
        self.starts.append(len(local))
        return offset


def _array_address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _parts(n: int, parts: int) -> list[tuple[int, int]]:
    """`n` pages cut into at most `parts` consecutive runs [lo, hi), none empty, the last about
    half the others' length: what is left after the last transfer (its checksums) is small."""
    k = max(1, min(n, parts))
    if k == 1:
        return [(0, n)]
    last = max(1, n // (2 * k))
    head = n - last
    return [(head * i // (k - 1), head * (i + 1) // (k - 1)) for i in range(k - 1)] + [(head, n)]


def _loose(regions: RegisteredRegions, local: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The DRAM of `local` outside the registered regions, merged into ranges. A batch of
    host-pool pages lies inside one region: one check of its span instead of one per piece."""
    if not local:
        return []
    start = min(ptr for ptr, _, _ in local)
    end = max(ptr + n for ptr, n, _ in local)
    if regions.covers(start, end - start):
        return []
    return _merge([(ptr, n) for ptr, n, _ in local if not regions.covers(ptr, n)])


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(ptr, nbytes) ranges merged where they overlap or touch (one registration each)."""
    merged: list[list[int]] = []
    for ptr, n in sorted(ranges):
        if merged and ptr <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], ptr + n)
        else:
            merged.append([ptr, ptr + n])
    return [(start, end - start) for start, end in merged]
