"""Mooncake Store backend throughput as a ratio to the raw Mooncake client, same run.

Starts a master and a storage process on loopback, pre-touches the segment, then alternates
rounds of: raw `batch_put_from` / `batch_get_into` of PAGES pages, and MooncakeBackend
`set_from` / `get_into` of the same pages (framed, checksummed, verified) from registered
host memory. Prints the median GB/s of each and the ratios (target >= 0.9).

    python bench/storage_mooncake.py [--pages 32] [--page-mib 2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("GLOG_minloglevel", "2")

import anyio  # noqa: E402
import numpy as np  # noqa: E402

from hicache.backends.mooncake import MooncakeBackend  # noqa: E402
from hicache.testing.mooncake_store import import_error, start_store  # noqa: E402


class BenchNamespace:
    prefix = "hicache:bench:"

    def key(self, h: str) -> str:
        return self.prefix + h


def main(argv: list[str] | None = None) -> dict[str, float] | None:
    """Run the comparison (bench/storage.py --backends mooncake calls this); returns the
    upload and prefetch ratios, or None when mooncake is not importable."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--page-mib", type=float, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    reason = import_error()
    if reason:
        print(f"skipped: {reason}")
        return None
    page = int(args.page_mib * (1 << 20))
    batch_bytes = args.pages * page
    segment = 4 * batch_bytes + (64 << 20)
    store = start_store(Path(tempfile.mkdtemp(prefix="mc-bench-")), segment=segment)
    try:
        return anyio.run(run, store, args.pages, page, args.rounds, segment)
    finally:
        store.stop()


async def run(store, pages: int, page: int, rounds: int, segment: int) -> dict[str, float]:
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", store.metadata, 0, 16 << 20, "tcp", "", f"127.0.0.1:{store.rpc_port}") == 0
    src = np.random.default_rng(0).integers(0, 256, (pages, page), dtype=np.uint8)
    dst = np.ones_like(src)
    raw.register_buffer(src.ctypes.data, src.nbytes)
    raw.register_buffer(dst.ctypes.data, dst.nbytes)
    backend = MooncakeBackend.from_spec(store.spec, namespace=BenchNamespace(), batch=pages,
                                        emit=lambda name, **f: print(name, f))
    backend.register_host_memory(src.ctypes.data, src.nbytes)
    backend.register_host_memory(dst.ctypes.data, dst.nbytes)
    sizes = [page] * pages
    src_ptrs = [src.ctypes.data + i * page for i in range(pages)]
    dst_ptrs = [dst.ctypes.data + i * page for i in range(pages)]
    srcs = [[memoryview(r)] for r in src]
    dsts = [[memoryview(r)] for r in dst]

    # Pre-touch the whole segment so neither side pays its first page faults.
    for w in range(segment // (pages * page)):
        keys = [f"warm{w}-{i}" for i in range(pages)]
        raw.batch_put_from(keys, src_ptrs, sizes)
    raw.remove_all(True)

    rates: dict[str, list[float]] = {"raw put": [], "raw get": [], "hicache set": [], "hicache get": []}
    nbytes = pages * page
    for r in range(rounds):
        keys = [hashlib.sha256(f"{r}-{i}".encode()).hexdigest() for i in range(pages)]
        t = time.perf_counter()
        assert all(c == 0 for c in await anyio.to_thread.run_sync(raw.batch_put_from, keys, src_ptrs, sizes))
        rates["raw put"].append(nbytes / (time.perf_counter() - t))
        t = time.perf_counter()
        assert all(c == page for c in await anyio.to_thread.run_sync(raw.batch_get_into, keys, dst_ptrs, sizes))
        rates["raw get"].append(nbytes / (time.perf_counter() - t))
        raw.batch_remove(keys, True)
        hkeys = [BenchNamespace().key(k) for k in keys]
        t = time.perf_counter()
        assert await backend.set_from(hkeys, srcs) == pages
        rates["hicache set"].append(nbytes / (time.perf_counter() - t))
        dst[:] = 1
        t = time.perf_counter()
        assert await backend.get_into(hkeys, dsts) == pages
        rates["hicache get"].append(nbytes / (time.perf_counter() - t))
        assert np.array_equal(dst, src)
        await backend.delete(hkeys)
    med = {k: statistics.median(v) / 1e9 for k, v in rates.items()}
    print(f"Mooncake Store, tcp on loopback: {pages} pages x {page / (1 << 20):g} MiB per batch, "
          f"median of {rounds} rounds")
    for k, v in med.items():
        print(f"  {k:12s} {v:6.2f} GB/s")
    print(f"  upload ratio   (hicache set / raw put) {med['hicache set'] / med['raw put']:.2f}")
    print(f"  prefetch ratio (hicache get / raw get) {med['hicache get'] / med['raw get']:.2f}")
    await backend.aclose()
    raw.close()
    return {"upload": med["hicache set"] / med["raw put"], "prefetch": med["hicache get"] / med["raw get"]}


if __name__ == "__main__":
    main()
