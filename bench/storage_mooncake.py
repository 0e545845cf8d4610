"""Mooncake Store backend throughput as a ratio to the raw Mooncake client, same run.

Starts a master and a storage process on loopback, pre-touches the segment, then alternates
rounds of: raw `batch_put_from` / `batch_get_into` of PAGES pages, and MooncakeBackend
`set_from` / `get_into` of the same pages (framed, checksummed, verified) from registered
host pools (page_first; with their header room, so a value moves as one piece); each round runs both on fresh keys, the same steps each, alternating which goes
first. Prints the median GB/s of each and, per direction, the median over rounds of the
round's hicache/raw ratio (target >= 0.9).

    python bench/storage_mooncake.py [--pages 32] [--page-mib 2] [--rounds 101] [--room BYTES] [--clients shared|separate]
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

import anyio
import numpy as np
import torch

from hicache.backends.mooncake import MooncakeBackend, connect_client
from hicache.backends.mooncake.spec import parse_spec
from hicache.backends.registered import address_of
from hicache.testing.mooncake_store import import_error, start_store


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
    ap.add_argument("--rounds", type=int, default=101)
    ap.add_argument(
        "--clients",
        choices=("shared", "separate"),
        default="shared",
        help="the backend drives the raw way's client (default) or its own",
    )
    ap.add_argument(
        "--room",
        type=int,
        default=None,
        help="host pool header room in bytes (default: the pool's choice; 0: none)",
    )
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
        return anyio.run(
            run, store, args.pages, page, args.rounds, segment, args.room, args.clients
        )
    finally:
        store.stop()


def host_pool(pages: int, page: int, room: int | None):
    """A page_first host pool of `pages` pages of `page` bytes (a 16-layer fp16 MHA geometry)."""
    from hicache.kernels import DevicePool, HostPool, MHAGeometry

    geometry = MHAGeometry(layers=16, heads=8, head_dim=128, dtype=torch.float16)
    page_size, rest = divmod(page, geometry.bytes_per_token)
    if rest or page_size == 0:
        raise SystemExit(
            f"--page-mib must be a multiple of {geometry.bytes_per_token >> 10} KiB here"
        )
    device = DevicePool.allocate(geometry, page_size, page_size)
    return HostPool(device, pages * page_size, "page_first", header_room=room)


async def run(
    store, pages: int, page: int, rounds: int, segment: int, room: int | None, clients: str
) -> dict[str, float]:
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    assert (
        raw.setup(
            "127.0.0.1", store.metadata, 0, 16 << 20, "tcp", "", f"127.0.0.1:{store.rpc_port}"
        )
        == 0
    )
    # With `shared`, the backend drives the very client the raw way uses: two clients are two
    # transfer engines whose threads and connections can differ for a whole run (separate
    # clients measured upload ratios from 0.83 to 1.04 between runs of this script).
    factory = (lambda _spec: raw) if clients == "shared" else connect_client
    backend = MooncakeBackend(
        parse_spec(store.spec, {"batch": pages}),
        namespace=BenchNamespace(),
        emit=lambda name, **f: print(name, f),
        client_factory=factory,
    )
    # Both move the same page bytes of the same two host pools, laid out as the cache has them
    # (page_first, with the header room the pool picks unless --room says otherwise): raw from
    # the pages themselves, hicache as framed values (header in the room: one piece a value).
    host_src, host_dst = (host_pool(pages, page, room) for _ in range(2))
    for host in (host_src, host_dst):
        if clients != "shared":
            raw.register_buffer(host.buffer.data_ptr(), host.nbytes)
        backend.register_host_memory(host.buffer.data_ptr(), host.nbytes)
    await backend.exists(
        ["connect-and-register"]
    )  # the backend registers the pools (shared: for both)
    slots = np.arange(host_src.size)
    srcs, dsts = host_src.page_buffers(slots), host_dst.page_buffers(slots)
    rng = np.random.default_rng(0)
    for piece in srcs:
        np.frombuffer(piece[0], dtype=np.uint8)[:] = rng.integers(0, 256, page, dtype=np.uint8)
    sizes = [page] * pages
    src_ptrs = [address_of(p[0]) for p in srcs]
    dst_ptrs = [address_of(p[0]) for p in dsts]

    def same_pages() -> bool:
        return all(bytes(d[0]) == bytes(s[0]) for d, s in zip(dsts, srcs))

    # Pre-touch the whole segment so neither side pays its first page faults.
    for w in range(segment // (pages * page)):
        keys = [f"warm{w}-{i}" for i in range(pages)]
        raw.batch_put_from(keys, src_ptrs, sizes)
    raw.remove_all(True)

    nbytes = pages * page

    async def raw_round(keys: list[str]) -> tuple[float, float]:
        t = time.perf_counter()
        assert all(
            c == 0
            for c in await anyio.to_thread.run_sync(raw.batch_put_from, keys, src_ptrs, sizes)
        )
        put = nbytes / (time.perf_counter() - t)
        host_dst.buffer.fill_(1)
        t = time.perf_counter()
        assert all(
            c == page
            for c in await anyio.to_thread.run_sync(raw.batch_get_into, keys, dst_ptrs, sizes)
        )
        get = nbytes / (time.perf_counter() - t)
        assert same_pages()
        raw.batch_remove(keys, True)
        return put, get

    async def hicache_round(keys: list[str]) -> tuple[float, float]:
        hkeys = [BenchNamespace().key(k) for k in keys]
        t = time.perf_counter()
        assert await backend.set_from(hkeys, srcs) == pages
        put = nbytes / (time.perf_counter() - t)
        host_dst.buffer.fill_(1)
        t = time.perf_counter()
        assert await backend.get_into(hkeys, dsts) == pages
        get = nbytes / (time.perf_counter() - t)
        assert same_pages()
        await backend.delete(hkeys)
        return put, get

    # Each round runs both ways on fresh keys, the same steps for each (put, dirty the
    # destination, get, check, remove); which goes first alternates, so neither always
    # inherits the other's cache and store state.
    rates: dict[str, list[float]] = {
        "raw put": [],
        "raw get": [],
        "hicache set": [],
        "hicache get": [],
    }
    for r in range(rounds + 1):  # round 0 warms up
        keys = [hashlib.sha256(f"{r}-{i}".encode()).hexdigest() for i in range(pages)]
        ways = [("raw put", "raw get", raw_round), ("hicache set", "hicache get", hicache_round)]
        for put_name, get_name, way in ways if r % 2 else ways[::-1]:
            put, get = await way(keys)
            if r:
                rates[put_name].append(put)
                rates[get_name].append(get)
    med = {k: statistics.median(v) / 1e9 for k, v in rates.items()}
    # The ratio of each round's back-to-back pair, then the median over rounds: drift between
    # rounds (other processes, the store's own housekeeping) cancels within a pair.
    ratios = {
        op: statistics.median(h / r for h, r in zip(rates[hc], rates[rw]))
        for op, hc, rw in (
            ("upload", "hicache set", "raw put"),
            ("prefetch", "hicache get", "raw get"),
        )
    }
    print(
        f"Mooncake Store, tcp on loopback: {pages} pages x {page / (1 << 20):g} MiB per batch, "
        f"median of {rounds} rounds, ways alternating first; host pool header room {host_src.header_room} B; "
        f"{clients} client(s)"
    )
    for k in rates:
        print(
            f"  {k:12s} {med[k]:6.2f} GB/s  (range {min(rates[k]) / 1e9:.2f}-{max(rates[k]) / 1e9:.2f})"
        )
    print(
        f"  upload ratio   (hicache set / raw put, median of per-round ratios) {ratios['upload']:.2f}"
    )
    print(
        f"  prefetch ratio (hicache get / raw get, median of per-round ratios) {ratios['prefetch']:.2f}"
    )
    await backend.aclose()  # closes `raw` too when shared
    if clients != "shared":
        raw.close()
    return ratios


if __name__ == "__main__":
    main()
