"""NIXL backend throughput against the raw NIXL API doing the same transfers, and the file store,
same run.

Per page size (16 and 64 tokens of a 32-layer, 8-head, 128-dim bfloat16 model: 2 and 8 MiB, 64
pieces each, layer-first), rounds alternate which goes first and each runs on fresh keys:

- raw NIXL: per batch of 16 pages, open one file per page, register the files, one transfer of
  every piece (host memory registered once; piece addresses taken as the backend takes them),
  wait, deregister, close; reading back the same way. No header, no checksum, no temporary
  file.
- `nixl:` backend: `set_from` / `get_into` of the same pages in batches of 16 (framed,
  checksummed, written to a temporary file and renamed, verified on read), host memory
  registered once as the cache does (`register_host_memory`).
- `file:` backend: the same calls.
- with `--fallback`, also the `nixl:` backend with the file store's compiled module hidden (as
  where it cannot be built): per-piece checksums, on the checksum pool while writing, after
  one transfer while reading.

Prints pages/s and GB/s of each (medians) and, per direction, the median over rounds of the
round's backend/raw ratio (target >= 0.9).

    python bench/storage_nixl.py [--rounds 5] [--pages 32] [--dir DIR] [--fallback]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio
import numpy as np

from bench.storage import BenchLayout, CaseResult, Shape, run_case
from hicache.backends.file import FileBackend
from hicache.backends.file import native as file_native
from hicache.backends.nixl import NixlBackend, NixlSpec, load_nixl, nixl_missing
from hicache.backends.registered import address_of

BATCH = 16


class RawNixl:
    """The NIXL Python API used directly, the way the backend uses it (same plugin and params)."""

    def __init__(self, directory: str, layout: BenchLayout, params: dict[str, str]) -> None:
        api = load_nixl()
        self.agent = api.nixl_agent("bench-raw", api.nixl_agent_config(backends=[]))
        self.agent.create_backend("POSIX", params)
        for array in (layout.source, layout.target):
            self.agent.register_memory([(array.ctypes.data, array.nbytes, 0, "")], "DRAM")
        self.directory = directory
        self.layout = layout

    def _batch(self, op: str, array: np.ndarray, pages: range, flags: int) -> None:
        agent, layout = self.agent, self.layout
        fds = [os.open(os.path.join(self.directory, f"raw-{p}"), flags, 0o600) for p in pages]
        local, remote = [], []
        for fd, page in zip(fds, pages):
            offset = 0
            for piece in layout.pieces(array, page):
                local.append((address_of(piece), piece.nbytes, 0))
                remote.append((offset, piece.nbytes, fd))
                offset += piece.nbytes
        files = agent.register_memory([(0, layout.shape.page_bytes, fd, "") for fd in fds], "FILE")
        handle = agent.initialize_xfer(
            op,
            agent.get_xfer_descs(local, "DRAM"),
            agent.get_xfer_descs(remote, "FILE"),
            agent.name,
        )
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        assert state == "DONE", state
        agent.release_xfer_handle(handle)
        agent.deregister_memory(files)
        for fd in fds:
            os.close(fd)

    def round(self) -> tuple[float, float]:
        layout = self.layout
        layout.target[:] = 0
        batches = [range(s, min(s + BATCH, layout.pages)) for s in range(0, layout.pages, BATCH)]
        t0 = time.perf_counter()
        for pages in batches:
            self._batch("WRITE", layout.source, pages, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        t1 = time.perf_counter()
        for pages in batches:
            self._batch("READ", layout.target, pages, os.O_RDONLY)
        t2 = time.perf_counter()
        assert np.array_equal(layout.source, layout.target)
        for p in range(layout.pages):
            os.unlink(os.path.join(self.directory, f"raw-{p}"))
        return t1 - t0, t2 - t1


async def _without_native(backend: NixlBackend, layout: BenchLayout, round_: int) -> CaseResult:
    """`run_case` with the compiled module hidden, as where it cannot be built."""
    real = file_native.native_file_io
    file_native.native_file_io = lambda: None
    try:
        return await run_case(backend, layout, round_=round_, batch=BATCH)
    finally:
        file_native.native_file_io = real


def compare(
    tokens: int, pages: int, rounds: int, root: str, fallback: bool = False
) -> dict[str, float]:
    layout = BenchLayout(Shape(tokens=tokens), pages)
    spec = NixlSpec.parse(f"nixl:{root}/nixl")
    raw = RawNixl(os.path.join(root, "raw"), layout, dict(spec.params))
    os.makedirs(raw.directory, exist_ok=True)
    names = ["raw", "nixl", "file", *(["fallback"] if fallback else [])]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {"set": [], "get": [], "fallback set": [], "fallback get": []}

    async def rounds_of_backends() -> None:
        nixl = NixlBackend(spec, namespace=layout.namespace)
        for array in (layout.source, layout.target):
            nixl.register_host_memory(array.ctypes.data, array.nbytes)
        files = FileBackend(f"{root}/file", namespace=layout.namespace, threads=4)
        for r in range(rounds):
            order = ["raw", "nixl", "file"] if r % 2 else ["nixl", "raw", "file"]
            if fallback:  # last in one round, first in the next
                order = [*order, "fallback"] if r % 2 else ["fallback", *order]
            got: dict[str, tuple[float, float]] = {}
            for name in order:
                if name == "raw":
                    got[name] = raw.round()
                    continue
                backend = files if name == "file" else nixl
                if name == "fallback":
                    result = await _without_native(nixl, layout, r)
                else:
                    result = await run_case(backend, layout, round_=r, batch=BATCH)
                total = layout.total_bytes / 1e9
                got[name] = (total / result.set_gbps, total / result.get_gbps)
                await backend.clear()
            for name, t in got.items():
                times[name].append(t)
            ratios["set"].append(got["raw"][0] / got["nixl"][0])
            ratios["get"].append(got["raw"][1] / got["nixl"][1])
            if fallback:
                ratios["fallback set"].append(got["raw"][0] / got["fallback"][0])
                ratios["fallback get"].append(got["raw"][1] / got["fallback"][1])
        await nixl.aclose()
        await files.aclose()

    anyio.run(rounds_of_backends)
    med = statistics.median
    page_mib = layout.shape.page_bytes / 2**20
    print(f"page {tokens} tokens ({page_mib:.0f} MiB, 64 pieces), {pages} pages per pass")
    for name in names:
        set_s = med(t[0] for t in times[name])
        get_s = med(t[1] for t in times[name])
        print(
            f"  {name:8s} put {pages / set_s:7.0f} pages/s {layout.total_bytes / set_s / 1e9:6.2f} GB/s"
            f" | get {pages / get_s:7.0f} pages/s {layout.total_bytes / get_s / 1e9:6.2f} GB/s"
        )
    out = {f"{op} {tokens}-token pages": med(ratios[op]) for op in ("set", "get")}
    print(
        f"  nixl / raw NIXL: put {out[f'set {tokens}-token pages']:.2f}"
        f"  get {out[f'get {tokens}-token pages']:.2f} (median of round ratios, target >= 0.9)"
    )
    if fallback:
        print(
            f"  fallback / raw NIXL: put {med(ratios['fallback set']):.2f}"
            f"  get {med(ratios['fallback get']):.2f} (without the compiled module)"
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, float] | None:
    """Run the comparison (bench/storage.py --backends nixl calls this); the ratios to raw
    NIXL, or None when NIXL is not installed."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--dir", default=None)
    ap.add_argument(
        "--fallback", action="store_true", help="also run the backend without the compiled module"
    )
    args = ap.parse_args(argv)
    missing = nixl_missing()
    if missing:
        print(f"nixl: skipped ({missing})")
        return None
    root = tempfile.mkdtemp(prefix="hicache-nixl-", dir=args.dir)
    try:
        ratios: dict[str, float] = {}
        for tokens in (16, 64):
            ratios.update(compare(tokens, args.pages, args.rounds, root, args.fallback))
        return ratios
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
