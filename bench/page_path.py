"""One page's way to the store and back, stage by stage (16 KiB pages, the replay's geometry).

Each stage runs alone over the same pages, in batches of one request's pages (the size the
uploader and the prefetcher hand a store), and prints its cost per page: what the store's
calls are made of, so that the per-page work beyond the bytes can be set against memcpy of the
same bytes (one large numpy copy, same run). Then the whole calls (set_from, exists, get_into)
of the memory and the file store over the same pages, for the sum to be checked against, and
of a memory store at its cap (LRU, full of other pages, so that every set evicts: a store's
steady state, where new values reuse the memory of evicted ones).

Stages: the chained page hash of a request's tokens (a Python call per page, and the one
compiled call per batch an open cache uses); the storage keys and the file paths; the
host pool's page views; the batch checks; the CRC-32 of a page, one page per call and a batch
in one native call; the value's header; the memory store's framing of a batch into new
values (header, copy, CRC-32 in one native call) and its unframing into the pages, its dict
and policy (a batch put, a batch got), and what a new value's memory costs alone (taken and
zeroed: the kernel's first touch of its pages, which the framing's copy pays for new values);
the file store's index (a batch written, a batch probed); the file system calls of a value written without a ttl (open, writev, close, rename)
and read by a store alone in its directory (open, fstat, read, close, checksum; no mtime touch
for a value written less than a second ago) in one native call per batch; a worker-thread
hop per batch. Last, a probe of the layout: plain system calls for a file per page against one
file per request's pages, written and read back.

Run: python bench/page_path.py [--pages N] [--repeats R] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import anyio
import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from storage import SMALL_BATCH, SMALL_KV, memcpy_seconds_per_byte, small_case

from hicache.backends.base import StorageBackend
from hicache.backends.batch import Counters, check_buffers
from hicache.backends.blocking import BlockingRunner
from hicache.backends.file import FileBackend
from hicache.backends.file.index import TMP_DIR, TOUCH_AFTER_S, FileIndex
from hicache.backends.file.native import native_file_io
from hicache.backends.framing import checksum, pack_header
from hicache.backends.keys import Namespace
from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.backends.simple import frame_values, unframe_values
from hicache.kernels.native.pagehash import install as install_page_hasher
from hicache.radix.hashes import chain_page_hashes, use_digest_loop

PAGE_TOKENS = 64


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    took = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        took.append(time.perf_counter() - t0)
    return min(took)


def batches(n: int) -> list[slice]:
    return [slice(s, min(s + SMALL_BATCH, n)) for s in range(0, n, SMALL_BATCH)]


def layout_probe(root: str, page_bytes: int, rounds: int = 20) -> list[tuple[str, float]]:
    """Plain system calls, no framing or checks: a file per page (open, writev, close, rename)
    against one file for a request's pages (the same calls once), and reads of each (open,
    read, close a page; one open segment, a pread a page): what a layout with several pages
    per file would save in the kernel."""
    buf = np.random.default_rng(1).integers(0, 256, page_bytes * SMALL_BATCH, dtype=np.uint8)
    pages = [memoryview(buf[i * page_bytes : (i + 1) * page_bytes]) for i in range(SMALL_BATCH)]
    out = memoryview(np.empty(page_bytes, dtype=np.uint8))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL

    def write_files(r: int) -> None:
        for i, page in enumerate(pages):
            temp = f"{root}/p{r}.{i}.tmp"
            fd = os.open(temp, flags, 0o600)
            os.writev(fd, [page])
            os.close(fd)
            os.rename(temp, f"{root}/p{r}.{i}")

    def write_segment(r: int) -> None:
        temp = f"{root}/s{r}.tmp"
        fd = os.open(temp, flags, 0o600)
        os.writev(fd, pages)
        os.close(fd)
        os.rename(temp, f"{root}/s{r}")

    def read_files(r: int) -> None:
        for i in range(SMALL_BATCH):
            fd = os.open(f"{root}/p{r}.{i}", os.O_RDONLY)
            os.readv(fd, [out])
            os.close(fd)

    def read_segment(r: int) -> None:
        fd = os.open(f"{root}/s{r}", os.O_RDONLY)
        for i in range(SMALL_BATCH):
            os.preadv(fd, [out], i * page_bytes)
        os.close(fd)

    rows = []
    for name, fn in (
        ("write: a file per page", write_files),
        (f"write: a file per {SMALL_BATCH} pages", write_segment),
        ("read: a file per page", read_files),
        ("read: a pread per page from one segment", read_segment),
    ):
        took = []
        for r in range(rounds):
            t0 = time.perf_counter()
            fn(r)
            took.append(time.perf_counter() - t0)
        rows.append((name, min(took) / SMALL_BATCH * 1e6))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=4800, help="pages per pass")
    ap.add_argument("--repeats", type=int, default=5, help="passes; the best is kept")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = ap.parse_args()

    import torch

    from hicache.kernels import DevicePool, HostPool
    from hicache.kernels.geometry import parse_geometry

    geometry = parse_geometry(SMALL_KV)
    pages = args.pages
    device = DevicePool.allocate(geometry, PAGE_TOKENS * 2, PAGE_TOKENS, device=torch.device("cpu"))
    host = HostPool(device, 2 * pages * PAGE_TOKENS, "page_first", pin_memory=False)
    page_bytes = PAGE_TOKENS * geometry.bytes_per_token
    host.buffer.numpy()[:] = np.random.default_rng(0).integers(
        0, 256, host.buffer.numpy().size, dtype=np.uint8
    )
    namespace = Namespace(model="bench-path", kv=SMALL_KV, page_size=PAGE_TOKENS)
    tokens = np.arange(pages * PAGE_TOKENS, dtype=np.int64)
    slots = np.arange(pages * PAGE_TOKENS, dtype=np.int64)
    memcpy_us = page_bytes * memcpy_seconds_per_byte(pages * page_bytes) * 1e6
    native = native_file_io()
    root = tempfile.mkdtemp(prefix="hicache-bench-path-", dir=args.dir)
    rows: list[tuple[str, float]] = []

    def stage(name: str, fn: Callable[[], object]) -> None:
        rows.append((name, best_of(args.repeats, fn) / pages * 1e6))

    def stage_kept(name: str, make: Callable[[], object]) -> None:
        """A stage whose result is kept, as a store keeps its values: freed after the clock."""
        took = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            made = make()
            took.append(time.perf_counter() - t0)
            del made
        rows.append((name, min(took) / pages * 1e6))

    try:
        store = FileBackend(root, namespace=namespace, threads=0)
        parts = batches(pages)
        token_runs = [tokens[p.start * PAGE_TOKENS : p.stop * PAGE_TOKENS] for p in parts]
        use_digest_loop(None)
        stage(
            "page hash (chained sha256), a Python call per page",
            lambda: [chain_page_hashes(t, PAGE_TOKENS) for t in token_runs],
        )
        if install_page_hasher():  # as an open cache hashes
            stage(
                "page hash (chained sha256), one compiled call a batch",
                lambda: [chain_page_hashes(t, PAGE_TOKENS) for t in token_runs],
            )
        hashes = chain_page_hashes(tokens, PAGE_TOKENS)
        keys = namespace.keys(hashes)
        stage("storage keys", lambda: [namespace.keys(hashes[p]) for p in parts])
        stage("file paths", lambda: [store._locate(keys[p]) for p in parts])
        slot_runs = [slots[p.start * PAGE_TOKENS : p.stop * PAGE_TOKENS] for p in parts]
        stage("host page views", lambda: [host.page_buffers(s) for s in slot_runs])
        views = host.page_buffers(slots)
        stage(
            "batch checks",
            lambda: [check_buffers(namespace, keys[p], views[p], writable=False) for p in parts],
        )
        stage("CRC-32, one page a call", lambda: [checksum(v) for v in views])
        if native is not None:
            stage(
                "CRC-32, a batch a call (native)",
                lambda: [native.checksums(views[p]) for p in parts],
            )
        stage("header", lambda: [pack_header(k, page_bytes, 0) for k in keys])
        framed = [frame_values(keys[p], views[p]) for p in parts]

        stage_kept(
            "memory: a batch framed, new values (one native call)",
            lambda: [frame_values(keys[p], views[p]) for p in parts],
        )
        back = host.page_buffers(slots + pages * PAGE_TOKENS)
        stage(
            "memory: a batch unframed into its pages (one native call)",
            lambda: [
                unframe_values(keys[p], f, back[p], Counters(), lambda *a, **k: None)
                for p, f in zip(parts, framed)
            ],
        )

        def memory_puts() -> MemoryStore:
            memory = MemoryStore(None)
            for p, f in zip(parts, framed):
                memory.put_many(keys[p], f)
            return memory

        stage("memory: dict and policy, a batch put", memory_puts)
        memory = memory_puts()
        stage(
            "memory: dict and policy, a batch got",
            lambda: [memory.get_many(keys[p]) for p in parts],
        )
        stage_kept(
            "memory: a new value's memory taken and zeroed (no copy)",
            lambda: [bytearray(page_bytes + 110) for _ in range(pages)],
        )
        entries = [(h, page_bytes + 4096, None) for h in hashes]

        def index_writes() -> None:
            index = FileIndex()
            for p in parts:
                index.wrote(entries[p])

        stage("index: a batch written", index_writes)
        index = FileIndex()
        index.wrote(entries)
        stage("index: a batch probed", lambda: [index.held_prefix(hashes[p], 0.0) for p in parts])
        if native is not None:
            _, paths = store._locate(keys)
            now_ns = time.time_ns()
            tmp = os.path.join(store._dir, TMP_DIR)
            seq = iter(range(10**9))

            def write_files() -> None:
                for p in parts:
                    native.write_values(
                        [
                            (k, path, f"{tmp}/{k[-64:]}.{next(seq)}.tmp", v, False, None)
                            for k, path, v in zip(keys[p], paths[p], views[p])
                        ]
                    )

            stage("files written (open, writev, close, rename)", write_files)
            out = host.page_buffers(slots + pages * PAGE_TOKENS)
            now = time.time()
            now_ns = time.time_ns()
            before = now_ns - int(TOUCH_AFTER_S * 1e9)

            def read_files() -> None:
                for p in parts:
                    native.read_values(
                        [
                            (k, path, v, now, now_ns, before)
                            for k, path, v in zip(keys[p], paths[p], out[p])
                        ]
                    )

            stage("files read and checked (open, fstat, read, close, CRC)", read_files)
        runner = BlockingRunner(2)

        async def hops() -> None:
            for _ in parts:
                await runner.run(int)

        stage("worker-thread hop, one a batch", lambda: anyio.run(hops))
        anyio.run(store.clear)
        anyio.run(store.aclose)  # the stores below are then alone in the directory
        whole: list[tuple[str, float]] = []
        at_cap = "memory at its cap (lru)"

        def open_store(name: str) -> StorageBackend:
            if name == "memory":
                return MemoryBackend(namespace=namespace, capacity_bytes=None)
            if name == at_cap:  # room for one pass of pages, with the headers and keys
                cap = pages * (page_bytes + 256)
                return MemoryBackend(namespace=namespace, capacity_bytes=cap, policy="lru")
            return FileBackend(root, namespace=namespace)

        for name in ("memory", at_cap, "file"):
            best: dict[str, float] = {}
            for r in range(args.repeats):
                backend = open_store(name)
                try:
                    if name == at_cap:  # full of other pages first: every set then evicts
                        anyio.run(small_case, backend, host, namespace, pages, r + args.repeats)
                    took = anyio.run(small_case, backend, host, namespace, pages, r)
                    if name == at_cap and not backend.stats().get("evictions"):
                        raise RuntimeError("the store at its cap evicted nothing")
                finally:
                    anyio.run(backend.clear)
                for op, s in took.items():
                    best[op] = min(best.get(op, s), s)
            whole += [(f"{name} {op}", s * 1e6) for op, s in best.items()]
        probe_dir = tempfile.mkdtemp(prefix="layout-", dir=root)
        layouts = layout_probe(probe_dir, page_bytes)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"page {page_bytes // 1024} KiB, {pages} pages in batches of {SMALL_BATCH}, best of "
        f"{args.repeats}; memcpy of a page {memcpy_us:.2f} us"
    )
    print(f"{'stage':<62}{'us/page':>9}")
    for name, us in rows:
        print(f"{name:<62}{us:>9.2f}")
    print(
        f"{'whole call (bench/storage.py --backends small)':<62}{'us/page':>9}{'beyond bytes':>14}"
    )
    for name, us in whole:
        beyond = us - (0 if name.endswith("exists") else memcpy_us)
        print(f"{name:<62}{us:>9.2f}{beyond:>14.2f}")
    print(f"{'layout probe (plain system calls)':<62}{'us/page':>9}")
    for name, us in layouts:
        print(f"{name:<62}{us:>9.2f}")


if __name__ == "__main__":
    main()
