"""Storage backend throughput: upload (set_from) and prefetch (get_into) GB/s.

The file backend is measured against plain-Python writes and reads of the same bytes into
the same directory in the same run (ratio target >= 0.8). Pages are page-sized values in a
layer-first host layout (one piece per layer and K/V), the shape the host pool hands out.

`--backends file redis mooncake` runs, in the same run, the Redis case (bench/storage_redis.py:
its own redis-server, RedisBackend against the raw redis.asyncio client) and the Mooncake case
(bench/storage_mooncake.py: its own master and storage process, MooncakeBackend against the
raw Mooncake client), each printing its ratios to its raw client (target >= 0.9); a summary
of every ratio ends the run. `--backends sealed` runs bench/storage_sealed.py (memory, file and
Redis with value tags and with encryption at rest, as ratios to plaintext; no target). `--redis-args` / `--mooncake-args` pass options to those cases.
`--backends nixl` runs bench/storage_nixl.py (the NIXL backend against the raw NIXL API doing
the same transfers, target >= 0.9, and the file store; `--nixl-args` passes its options).

Other backends add themselves as further cases from their own files:

    from bench.storage import BenchLayout, run_case
    result = anyio.run(run_case, my_backend, layout)   # -> CaseResult with set/get GB/s

`--backends small` (in the default set) measures the cost of one page op at a small page (16 KiB:
the replay's geometry, 64 tokens of a 2-layer fp16 head of 32) for the memory and the file store,
the pages handed out by a host pool as the uploader and the prefetcher get them, in batches of a
request's pages: time per page of set_from, exists and get_into, less the same bytes copied at
memcpy speed (one large numpy copy, same run). Target: <= 5 us per page beyond the bytes.

Run: python bench/storage.py [--backends file small redis mooncake] [--pages N] [--repeats R]
     [--dir DIR] [--threads T] [--redis-args "--rounds 21"] [--mooncake-args "--rounds 7"]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import anyio
import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hicache.backends.base import StorageBackend
from hicache.backends.file import FileBackend
from hicache.backends.keys import Namespace
from hicache.radix.hashes import chain_page_hashes


@dataclass(frozen=True, slots=True)
class Shape:
    """Page geometry: bytes of one piece = tokens x heads x head_dim x itemsize."""

    tokens: int = 64
    layers: int = 32
    heads: int = 8
    head_dim: int = 128
    itemsize: int = 2

    @property
    def piece_bytes(self) -> int:
        return self.tokens * self.heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        return 2 * self.layers * self.piece_bytes

    @property
    def kv(self) -> str:
        return f"mha:{self.layers}:{self.heads}:{self.head_dim}:bfloat16"


class BenchLayout:
    """Source and target host buffers (layer-first, [layers, K/V, pages, piece]) and the
    keys of `pages` pages; one fresh key range per `round`."""

    def __init__(self, shape: Shape, pages: int, seed: int = 0) -> None:
        self.shape, self.pages = shape, pages
        self.namespace = Namespace(model="bench", kv=shape.kv, page_size=shape.tokens)
        rng = np.random.default_rng(seed)
        dims = (shape.layers, 2, pages, shape.piece_bytes)
        self.source = rng.integers(0, 256, dims, dtype=np.uint8)
        self.target = np.zeros(dims, dtype=np.uint8)

    def pieces(self, array: np.ndarray, page: int) -> list[memoryview]:
        return [memoryview(array[l, kv, page]) for l in range(self.shape.layers) for kv in range(2)]

    def keys(self, round_: int) -> list[str]:
        tokens = np.arange(self.pages * self.shape.tokens) + round_ * 10**6
        return self.namespace.keys(chain_page_hashes(tokens, self.shape.tokens))

    @property
    def total_bytes(self) -> int:
        return self.pages * self.shape.page_bytes


@dataclass(frozen=True, slots=True)
class CaseResult:
    set_gbps: float
    get_gbps: float


async def run_case(
    backend: StorageBackend, layout: BenchLayout, *, round_: int = 0, batch: int = 16
) -> CaseResult:
    """Upload every page of `layout`, read it all back into the target, verify the bytes."""
    keys = layout.keys(round_)
    layout.target[:] = 0
    t0 = time.perf_counter()
    for s in range(0, len(keys), batch):
        part = keys[s : s + batch]
        stored = await backend.set_from(
            part, [layout.pieces(layout.source, s + i) for i in range(len(part))]
        )
        assert stored == len(part), f"stored {stored} of {len(part)}"
    t1 = time.perf_counter()
    for s in range(0, len(keys), batch):
        part = keys[s : s + batch]
        got = await backend.get_into(
            part, [layout.pieces(layout.target, s + i) for i in range(len(part))]
        )
        assert got == len(part), f"read {got} of {len(part)}"
    t2 = time.perf_counter()
    assert np.array_equal(layout.source, layout.target), "bytes read back differ"
    return CaseResult(layout.total_bytes / (t1 - t0) / 1e9, layout.total_bytes / (t2 - t1) / 1e9)


def plain_python(directory: str, layout: BenchLayout, *, fsync: bool) -> CaseResult:
    """The reference: open/write/close each page's pieces to its own file, then
    open/readinto/close them back; no header, no checksum, no temp file, one thread."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"plain-{i}") for i in range(layout.pages)]
    layout.target[:] = 0
    t0 = time.perf_counter()
    for i, path in enumerate(paths):
        with open(path, "wb") as f:
            f.writelines(layout.pieces(layout.source, i))
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    t1 = time.perf_counter()
    for i, path in enumerate(paths):
        with open(path, "rb") as f:
            for piece in layout.pieces(layout.target, i):
                f.readinto(piece)
    t2 = time.perf_counter()
    assert np.array_equal(layout.source, layout.target)
    for path in paths:
        os.unlink(path)
    return CaseResult(layout.total_bytes / (t1 - t0) / 1e9, layout.total_bytes / (t2 - t1) / 1e9)


async def compare_file(
    root: str, layout: BenchLayout, *, fsync: bool, threads: int, repeats: int
) -> dict[str, float]:
    """Alternate reference and backend rounds; medians of each."""
    backend = FileBackend(root, namespace=layout.namespace, fsync=fsync, threads=threads)
    ref, ours = [], []
    for r in range(repeats):
        ref.append(plain_python(root, layout, fsync=fsync))
        ours.append(await run_case(backend, layout, round_=r))
        await backend.clear()
    med = statistics.median
    out = {
        "plain_set": med([x.set_gbps for x in ref]),
        "plain_get": med([x.get_gbps for x in ref]),
        "file_set": med([x.set_gbps for x in ours]),
        "file_get": med([x.get_gbps for x in ours]),
    }
    out["set_ratio"] = out["file_set"] / out["plain_set"]
    out["get_ratio"] = out["file_get"] / out["plain_get"]
    return out


def run_file(args: argparse.Namespace) -> dict[str, float]:
    """The file backend against plain Python, with and without fsync; returns the ratios."""
    shape = Shape()
    layout = BenchLayout(shape, args.pages)
    root = tempfile.mkdtemp(prefix="hicache-bench-", dir=args.dir)
    print(
        f"page {shape.page_bytes / 2**20:.1f} MiB ({shape.tokens} tokens x {shape.layers} layers x K/V x "
        f"{shape.heads} heads x {shape.head_dim} x {shape.itemsize} B, {2 * shape.layers} pieces); "
        f"{args.pages} pages per pass, batches of 16, median of {args.repeats}; dir {root}"
    )
    ratios: dict[str, float] = {}
    try:
        for fsync in (False, True):
            r = anyio.run(
                lambda: compare_file(
                    root, layout, fsync=fsync, threads=args.threads, repeats=args.repeats
                )
            )
            print(
                f"fsync={fsync!s:5}  upload {r['file_set']:6.2f} GB/s vs plain {r['plain_set']:6.2f}  "
                f"ratio {r['set_ratio']:.2f} | prefetch {r['file_get']:6.2f} GB/s vs plain "
                f"{r['plain_get']:6.2f}  ratio {r['get_ratio']:.2f}"
            )
            ratios[f"upload fsync={fsync}"] = r["set_ratio"]
            ratios[f"prefetch fsync={fsync}"] = r["get_ratio"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return ratios


SMALL_KV = "mha:2:1:32:float16"  # 64-token pages of 16 KiB, the replay's default geometry
SMALL_BATCH = 240  # pages per call: one request of the shipped trace, on average


def memcpy_seconds_per_byte(nbytes: int, repeats: int = 5) -> float:
    """One large copy of `nbytes` (numpy, one thread): the pace the bytes themselves set."""
    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best / nbytes


async def small_case(
    backend: StorageBackend, host, namespace, pages: int, round_: int
) -> dict[str, float]:
    """Seconds per page of set_from, exists and get_into over `pages` host pages in batches
    of SMALL_BATCH, the pages read back into other slots and compared."""
    from hicache.radix.hashes import chain_page_hashes

    size = host.page_size
    tokens = np.arange(pages * size, dtype=np.int64) + round_ * 10**7
    keys = namespace.keys(chain_page_hashes(tokens, size))
    src = np.arange(pages, dtype=np.int64) * size
    dst = src + pages * size
    raw = host.buffer.numpy()
    raw[: raw.size // 2] = np.random.default_rng(round_).integers(
        0, 256, raw.size // 2, dtype=np.uint8
    )
    batches = range(0, pages, SMALL_BATCH)
    out = {}
    t0 = time.perf_counter()
    for s in batches:
        slots = (src[s : s + SMALL_BATCH, None] + np.arange(size)).ravel()
        stored = await backend.set_from(keys[s : s + SMALL_BATCH], host.page_buffers(slots))
        assert stored == len(keys[s : s + SMALL_BATCH]), f"stored {stored}"
    out["set_from"] = (time.perf_counter() - t0) / pages
    t0 = time.perf_counter()
    for s in batches:
        found = await backend.exists(keys[s : s + SMALL_BATCH])
        assert found == len(keys[s : s + SMALL_BATCH]), f"found {found}"
    out["exists"] = (time.perf_counter() - t0) / pages
    t0 = time.perf_counter()
    for s in batches:
        slots = (dst[s : s + SMALL_BATCH, None] + np.arange(size)).ravel()
        got = await backend.get_into(keys[s : s + SMALL_BATCH], host.page_buffers(slots))
        assert got == len(keys[s : s + SMALL_BATCH]), f"read {got}"
    out["get_into"] = (time.perf_counter() - t0) / pages
    a = host.page_buffers((src[:, None] + np.arange(size)).ravel())
    b = host.page_buffers((dst[:, None] + np.arange(size)).ravel())
    assert all(bytes(x[0]) == bytes(y[0]) for x, y in zip(a, b)), "bytes read back differ"
    return out


def run_small(args: argparse.Namespace) -> list[tuple[str, str, float]]:
    """Per page op at 16 KiB pages, memory and file store, less memcpy of the same bytes."""
    import torch

    from hicache.backends.memory import MemoryBackend
    from hicache.kernels import DevicePool, HostPool
    from hicache.kernels.geometry import parse_geometry

    geometry = parse_geometry(SMALL_KV)
    page_size = 64
    pages = args.small_pages
    device = DevicePool.allocate(geometry, page_size * 2, page_size, device=torch.device("cpu"))
    host = HostPool(device, 2 * pages * page_size, "page_first", pin_memory=False)
    page_bytes = page_size * geometry.bytes_per_token
    namespace = Namespace(model="bench-small", kv=SMALL_KV, page_size=page_size)
    per_byte = memcpy_seconds_per_byte(pages * page_bytes)
    print(
        f"page {page_bytes // 1024} KiB, {pages} pages per pass in batches of {SMALL_BATCH}, "
        f"best of {args.repeats}; memcpy {page_bytes * per_byte * 1e6:.2f} us per page "
        f"({1 / per_byte / 1e9:.1f} GB/s, one thread)"
    )
    root = tempfile.mkdtemp(prefix="hicache-bench-small-", dir=args.small_dir)
    rows = []
    try:
        for name in ("memory", "file"):
            best: dict[str, float] = {}
            for r in range(args.repeats):
                if name == "memory":
                    backend = MemoryBackend(namespace=namespace, capacity_bytes=None)
                else:
                    backend = FileBackend(root, namespace=namespace, threads=args.threads)
                try:
                    took = anyio.run(small_case, backend, host, namespace, pages, r)
                finally:
                    anyio.run(backend.clear)
                    anyio.run(backend.aclose)
                for op, t in took.items():
                    best[op] = min(best.get(op, float("inf")), t)
            for op, t in best.items():
                bytes_us = 0.0 if op == "exists" else page_bytes * per_byte * 1e6
                beyond = t * 1e6 - bytes_us
                print(f"{name:7s} {op:9s} {t * 1e6:7.2f} us/page  ({beyond:6.2f} beyond the bytes)")
                rows.append((name, op, beyond))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--backends",
        nargs="+",
        choices=("file", "small", "redis", "mooncake", "nixl", "sealed"),
        default=["file", "small"],
    )
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--small-pages", type=int, default=24000, help="pages per pass, small case")
    ap.add_argument(
        "--small-dir",
        default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None,
        help="where the small case's file store goes (default: /dev/shm, as the replay's)",
    )
    ap.add_argument("--dir", default=None, help="directory to write in (default: a fresh temp dir)")
    ap.add_argument("--redis-args", default="", help="options for bench/storage_redis.py")
    ap.add_argument("--mooncake-args", default="", help="options for bench/storage_mooncake.py")
    ap.add_argument("--nixl-args", default="", help="options for bench/storage_nixl.py")
    args = ap.parse_args(argv)
    summary: list[tuple[str, str, float, float]] = []  # backend, case, ratio, target
    for name in dict.fromkeys(args.backends):  # in the order given, once each
        print(f"== {name}")
        if name == "file":
            summary += [("file", case, r, 0.8) for case, r in run_file(args).items()]
        elif name == "small":
            for backend, case, us in run_small(args):
                summary.append((backend, f"{case} us/page", us, -5.0))
        elif name == "redis":
            from bench import storage_redis

            rows = storage_redis.main(shlex.split(args.redis_args))
            summary += [("redis", f"{op} {kib} KiB", r, 0.9) for kib, op, r in rows]
        elif name == "nixl":
            from bench import storage_nixl

            ratios = storage_nixl.main(shlex.split(args.nixl_args))
            summary += [("nixl", op, r, 0.9) for op, r in (ratios or {}).items()]
        elif name == "sealed":
            from bench import storage_sealed

            for backend, case, r in storage_sealed.main(["--backends", "memory", "file", "redis"]):
                summary.append((f"{backend}+seal", case, r, 0.0))
        else:
            from bench import storage_mooncake

            ratios = storage_mooncake.main(shlex.split(args.mooncake_args))
            summary += [("mooncake", op, r, 0.9) for op, r in (ratios or {}).items()]
    print("== ratio to the raw client / plain Python, same run")
    for backend, case, ratio, target in summary:
        if target < 0:  # a cost: at most -target
            ok = ratio <= -target
            print(
                f"  {backend:9s} {case:22s} {ratio:5.2f}  {'ok' if ok else 'MISSED'} (target <= {-target})"
            )
            continue
        print(
            f"  {backend:9s} {case:22s} {ratio:5.2f}  {'ok' if ratio >= target else 'MISSED'} (target >= {target})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
