"""Per-page cost of the file store's I/O loops and of the replay's stand-in KV (fill and check).

Run: python bench/file_pages.py [--pages 20000] [--dir /dev/shm] [--tokens 64000] [--repeats 7]

File store: `--pages` values of 16 KiB (the replay's page: 64 tokens of mha:2:1:32:float16)
written, probed (`exists`) and read back through backends/file/io.py's Python loops and through the
compiled loops (backends/file/native.py, where they build), one thread, in a fresh directory under
`--dir` (default /dev/shm, else the system's temporary directory); per page: wall, user and
system microseconds (this process's rusage).

Stand-in: `fill` and `count_bad_pages` of `--tokens` tokens in whole aligned pages of a 200k-token
CPU pool, on the page path (blocks from a page table) and on the row path (the table turned
off), best of `--repeats`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hicache.backends.file import io as file_io
from hicache.backends.file.native import native_file_io, unavailable_reason
from hicache.kernels.geometry import parse_geometry
from hicache.kernels.pools import DevicePool
from hicache.testing import kvfill

PAGE = 16384


def usage() -> tuple[float, float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_utime, r.ru_stime


def per_page(label: str, n: int, run: Callable[[], object]) -> None:
    t0, u0, s0 = usage()
    run()
    t1, u1, s1 = usage()
    print(
        f"  {label:26s} wall {1e6 * (t1 - t0) / n:6.1f} us/page  "
        f"user {1e6 * (u1 - u0) / n:5.1f}  sys {1e6 * (s1 - s0) / n:5.1f}"
    )


def file_io_costs(pages: int, where: str | None) -> None:
    native = native_file_io()
    print(f"file store, {pages} values of {PAGE // 1024} KiB under {where or 'the temp dir'}")
    if native is None:
        print(f"  (compiled loops not built: {unavailable_reason()})")
    payload = memoryview(bytearray(os.urandom(PAGE)))
    targets = [memoryview(bytearray(PAGE)) for _ in range(64)]
    keys = [
        "hicache:0123456789abcdef0123:" + hashlib.sha256(str(i).encode()).hexdigest()
        for i in range(pages)
    ]
    ways: list[tuple[str, object]] = [("python", None)]
    if native is not None:
        ways.append(("compiled", native))
    for name, way in ways:
        root = tempfile.mkdtemp(prefix="hicache-bench-", dir=where)
        try:
            os.mkdir(os.path.join(root, "tmp"))

            def path(k: str, root: str = root) -> str:
                h = k[-64:]
                return f"{root}/{h[:2]}/{h[2]}/{h}"

            writes = [
                (k, path(k), f"{root}/tmp/{i}.tmp", [payload], False, (1, 2))
                for i, k in enumerate(keys)
            ]
            reads = [(k, path(k), [targets[i % 64]], 100.0, 5) for i, k in enumerate(keys)]
            paths = [path(k) for k in keys]
            # the first pass makes the shard directories; the measured one replaces the values
            for job in writes:
                file_io.write_value(job)
            if way is None:
                per_page(f"{name}: write", pages, lambda: [file_io.write_value(j) for j in writes])
                per_page(f"{name}: exists", pages, lambda: file_io.count_present(paths, 100.0))
                per_page(f"{name}: read", pages, lambda: [file_io.read_value(j) for j in reads])
            else:
                assert native is not None
                per_page(f"{name}: write", pages, lambda: native.write_values(writes))
                per_page(f"{name}: exists", pages, lambda: native.count_present(paths, 100.0))
                per_page(f"{name}: read", pages, lambda: native.read_values(reads))
        finally:
            shutil.rmtree(root, ignore_errors=True)


def kvfill_costs(tokens: int, repeats: int) -> None:
    page = 64
    pool = DevicePool.allocate(parse_geometry("mha:2:1:32:float16"), 200_000, page)
    rng = np.random.default_rng(0)
    print(f"stand-in KV, {tokens} tokens of mha:2:1:32:float16 in whole pages (best of {repeats})")
    real_table = kvfill._page_table
    for path_name in ("page path", "row path"):
        if path_name == "row path":
            kvfill._page_table = lambda width, page_size: None  # type: ignore[assignment]
        best_fill = best_check = float("inf")
        for _ in range(repeats):
            pages = rng.choice(200_000 // page, size=tokens // page, replace=False)
            slots = (pages[:, None] * page + np.arange(page)).reshape(-1)
            seeds = rng.integers(0, 1 << 16, size=len(pages) + 1)
            t0 = time.perf_counter()
            kvfill.fill(pool, slots, seeds, page_size=page, first=0)
            t1 = time.perf_counter()
            bad = kvfill.count_bad_pages(pool, slots, seeds, page_size=page, first=0)
            t2 = time.perf_counter()
            assert bad == 0
            best_fill, best_check = min(best_fill, t1 - t0), min(best_check, t2 - t1)
        kvfill._page_table = real_table
        print(f"  {path_name:10s} fill {1e3 * best_fill:6.2f} ms  check {1e3 * best_check:6.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pages", type=int, default=20000)
    parser.add_argument("--dir", default=None, help="where the values go (default /dev/shm)")
    parser.add_argument("--tokens", type=int, default=64000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    where = args.dir
    if where is None and os.access("/dev/shm", os.W_OK):
        where = "/dev/shm"
    file_io_costs(args.pages, where)
    kvfill_costs(args.tokens, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
