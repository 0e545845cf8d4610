"""AIBrix KVCache backend throughput against AIBrix's own connector API doing the same puts and
gets, same run. Runs in the aibrix venv (`make aibrix-env`; `.venv-aibrix/bin/python
bench/storage_aibrix.py`).

Per page size (16 and 64 tokens of a 32-layer, 8-head, 128-dim bfloat16 model: 2 and 8 MiB,
64 pieces each, layer-first), rounds alternate which goes first and each runs on fresh keys:

- raw AIBrix: per batch of 16 pages, each page joined into one buffer (the connector takes one
  region per value) and `await connector.put(key, region)` for all of them concurrently; read
  back with `await connector.get(key, region)` into a page-sized region and copied out into the
  page's pieces. No header, no checksum.
- `aibrix:` backend: `set_from` / `get_into` of the same pages (framed, CRC-32, verified).

Both use one RocksDB connector (the backend's, opened in the same directory). Prints pages/s
and GB/s (medians) and, per direction, the median of the per-round backend/raw ratios (target
>= 0.9).

    python bench/storage_aibrix.py [--rounds 5] [--pages 32]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio
import numpy as np

from bench.storage import BenchLayout, Shape, run_case
from hicache.backends.aibrix import AibrixBackend, _regions, _Shared, aibrix_missing

BATCH = 16


async def raw_round(conn: object, layout: BenchLayout, round_: int) -> tuple[float, float]:
    owned, _ = _regions()
    keys = [f"raw:{round_}:{i}".encode() for i in range(layout.pages)]
    layout.target[:] = 0
    t0 = time.perf_counter()
    for s in range(0, layout.pages, BATCH):
        regions = [
            owned(bytearray(b"".join(layout.pieces(layout.source, p))))
            for p in range(s, min(s + BATCH, layout.pages))
        ]
        statuses = await asyncio.gather(
            *(conn.put(keys[s + i], r) for i, r in enumerate(regions))  # type: ignore[attr-defined]
        )
        assert all(st.is_ok() for st in statuses)
    t1 = time.perf_counter()
    for s in range(0, layout.pages, BATCH):
        pages = range(s, min(s + BATCH, layout.pages))
        regions = [owned(bytearray(layout.shape.page_bytes)) for _ in pages]
        statuses = await asyncio.gather(
            *(conn.get(keys[p], r) for p, r in zip(pages, regions))  # type: ignore[attr-defined]
        )
        assert all(st.is_ok() for st in statuses)
        for p, region in zip(pages, regions):
            flat = region.slab.numpy()
            offset = 0
            for piece in layout.pieces(layout.target, p):
                np.frombuffer(piece, np.uint8)[:] = flat[offset : offset + piece.nbytes]
                offset += piece.nbytes
    t2 = time.perf_counter()
    assert np.array_equal(layout.source, layout.target)
    for key in keys:
        await conn.delete(key)  # type: ignore[attr-defined]
    return t1 - t0, t2 - t1


async def compare(tokens: int, pages: int, rounds: int, root: str) -> dict[str, float]:
    layout = BenchLayout(Shape(tokens=tokens), pages)
    backend = AibrixBackend(f"{root}/{tokens}", namespace=layout.namespace)
    await backend.connect()
    conn = _Shared.open[backend.path][0]
    times: dict[str, list[tuple[float, float]]] = {"raw": [], "aibrix": []}
    ratios: dict[str, list[float]] = {"set": [], "get": []}
    for r in range(rounds):
        got: dict[str, tuple[float, float]] = {}
        for name in ["raw", "aibrix"] if r % 2 else ["aibrix", "raw"]:
            if name == "raw":
                got[name] = await raw_round(conn, layout, r)
            else:
                result = await run_case(backend, layout, round_=r, batch=BATCH)
                total = layout.total_bytes / 1e9
                got[name] = (total / result.set_gbps, total / result.get_gbps)
                await backend.delete(layout.keys(r))
        for name, t in got.items():
            times[name].append(t)
        ratios["set"].append(got["raw"][0] / got["aibrix"][0])
        ratios["get"].append(got["raw"][1] / got["aibrix"][1])
    await backend.aclose()
    med = statistics.median
    print(
        f"page {tokens} tokens ({layout.shape.page_bytes / 2**20:.0f} MiB, 64 pieces), {pages} pages"
    )
    for name in ("raw", "aibrix"):
        set_s, get_s = med(t[0] for t in times[name]), med(t[1] for t in times[name])
        print(
            f"  {name:6s} put {pages / set_s:6.0f} pages/s {layout.total_bytes / set_s / 1e9:5.2f} GB/s"
            f" | get {pages / get_s:6.0f} pages/s {layout.total_bytes / get_s / 1e9:5.2f} GB/s"
        )
    out = {f"{op} {tokens}-token pages": med(ratios[op]) for op in ("set", "get")}
    print(
        f"  aibrix backend / raw connector: put {out[f'set {tokens}-token pages']:.2f}"
        f"  get {out[f'get {tokens}-token pages']:.2f} (median of round ratios, target >= 0.9)"
    )
    return out


def main(argv: list[str] | None = None) -> dict[str, float] | None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    missing = aibrix_missing()
    if missing:
        print(f"aibrix: skipped ({missing})")
        return None
    root = tempfile.mkdtemp(prefix="hicache-aibrix-", dir=args.dir)
    try:
        ratios: dict[str, float] = {}
        for tokens in (16, 64):
            ratios.update(anyio.run(compare, tokens, args.pages, args.rounds, root))
        return ratios
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
