"""hicache's storage backend inside SGLang against SGLang's own `HiCacheFile`, in one run, on
the same host pool (SGLang's MHA host pool on CPU) and directories on the same filesystem:
pages per second to store a batch of host pages and to read it back into other host pages,
each the way SGLang's cache controller calls the backend:

- `HiCacheFile` (SGLang's `file` backend): the legacy path, as `_generic_page_set` /
  `_generic_page_get` do it: `batch_set` of `get_data_page` copies, `batch_get` into dummy
  pages, then `set_from_flat_data_page` per page;
- hicache (`file:DIR`, through SGLang's `dynamic` loader, `interface_v1: 1`): `batch_set_v1` /
  `batch_get_v1` on host indices, read and written in place; and, for the record, the same
  legacy path as HiCacheFile.

Every read is checked: the host pages read back must equal the pages written, byte for byte
(the run stops otherwise); the bytes checked are printed. Each round stores fresh keys into
emptied directories (HiCacheFile skips keys it already holds), batches of 128 pages as SGLang's
controller sends them; the median of the rounds is reported with its ratio to HiCacheFile's.

Run with SGLang's venv (`make sglang-env`):

    .venv-sglang/bin/python bench/sglang_storage.py [--pages 512] [--rounds 5] [--dir DIR]
        [--layout layer_first] [--layers 8] [--page-size 64]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "sglang"))

from sglang_cpu import (  # noqa: E402
    dynamic_extra,
    mha_host,
    sglang_missing,
    storage_config,
)

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE


def page_bytes(host: Any, slot: int) -> bytes:
    import torch

    return bytes(host.get_data_page(slot, flat=True).contiguous().view(torch.uint8).numpy())


def legacy_set(backend: Any, host: Any, keys: list[str], slots: list[int]) -> bool:
    data = [host.get_data_page(s) for s in slots]  # SGLang's _generic_page_set
    return bool(backend.batch_set(keys, data))


def legacy_get(backend: Any, host: Any, keys: list[str], slots: list[int]) -> int:
    dummy = [host.get_dummy_flat_data_page() for _ in keys]  # SGLang's _generic_page_get
    pages = backend.batch_get(keys, dummy)
    count = 0
    for slot, page in zip(slots, pages):
        if page is None:
            break
        host.set_from_flat_data_page(slot, page)
        count += 1
    return count


def v1_set(backend: Any, host: Any, keys: list[str], slots: list[int]) -> bool:
    return all(backend.batch_set_v1(keys, indices(host, slots)))


def v1_get(backend: Any, host: Any, keys: list[str], slots: list[int]) -> int:
    got = backend.batch_get_v1(keys, indices(host, slots))
    return got.index(False) if False in got else len(got)


def indices(host: Any, slots: list[int]) -> Any:
    import torch

    return torch.cat([torch.arange(s, s + host.page_size, dtype=torch.int64) for s in slots])


def run_round(
    name: str, backend: Any, host: Any, ops: tuple[Any, Any], pages: int, tag: str
) -> tuple[float, float, int]:
    """One round: store `pages` pages (the first half of the pool), read them into the second
    half, check every byte. Returns (set pages/s, get pages/s, bytes checked)."""
    setter, getter = ops
    ps = host.page_size
    src = [i * ps for i in range(pages)]
    dst = [(pages + i) * ps for i in range(pages)]
    keys = [f"{tag}{i:058x}"[:64] for i in range(pages)]
    t0 = time.perf_counter()
    for b in range(0, pages, BATCH):
        if not setter(backend, host, keys[b : b + BATCH], src[b : b + BATCH]):
            raise SystemExit(f"{name}: a batch was not stored")
    t1 = time.perf_counter()
    for b in range(0, pages, BATCH):
        n = len(keys[b : b + BATCH])
        if getter(backend, host, keys[b : b + BATCH], dst[b : b + BATCH]) != n:
            raise SystemExit(f"{name}: a batch was not read back")
    t2 = time.perf_counter()
    checked = 0
    for s, d in zip(src, dst):
        a, b2 = page_bytes(host, s), page_bytes(host, d)
        if a != b2:
            raise SystemExit(f"{name}: page at host slot {d} differs from the one written")
        checked += len(a)
    return pages / (t1 - t0), pages / (t2 - t1), checked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=512, help="pages per round (default 512)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--dir", default=None, help="parent directory of the stores (default: a temp dir)"
    )
    ap.add_argument(
        "--layout", default="layer_first", help="SGLang host layout (default layer_first)"
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    args = ap.parse_args()
    if (why := sglang_missing()) is not None:
        print(f"sglang_storage: skipped ({why})")
        return
    import sglang
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    host = mha_host(
        args.layout,
        page_size=args.page_size,
        layers=args.layers,
        heads=args.heads,
        head_dim=args.head_dim,
        tokens=args.pages * args.page_size,
    )
    if host.size < 2 * args.pages * args.page_size:
        raise SystemExit(f"host pool of {host.size} tokens holds fewer than 2 x {args.pages} pages")
    page = host.get_dummy_flat_data_page()
    page_nbytes = page.numel() * page.element_size()
    parent = tempfile.mkdtemp(prefix="sglang-storage-", dir=args.dir)
    print(
        f"# sglang {sglang.__version__}, torch {torch.__version__}; host pool {args.layout}, "
        f"{args.layers} layers x {args.heads} heads x {args.head_dim} bf16, page {args.page_size} "
        f"tokens = {page_nbytes / 2**20:.2f} MiB; {args.pages} pages a round, batches of {BATCH}; "
        f"stores under {parent}"
    )
    cases: list[tuple[str, Any, tuple[Any, Any]]] = []
    try:
        sg_dir = os.path.join(parent, "sglang-file")
        theirs = HiCacheFile(storage_config(extra={"file_storage_path": sg_dir}))
        theirs.register_mem_pool_host(host)
        ours = StorageBackendFactory.create_backend(
            "dynamic",
            storage_config(extra=dynamic_extra(f"file:{os.path.join(parent, 'hicache')}")),
            host,
        )
        ours.register_mem_pool_host(host)
        cases = [
            ("SGLang HiCacheFile (legacy path)", theirs, (legacy_set, legacy_get)),
            ("hicache file: (v1, in place)", ours, (v1_set, v1_get)),
            ("hicache file: (legacy path)", ours, (legacy_set, legacy_get)),
        ]
        results: dict[str, list[tuple[float, float, int]]] = {n: [] for n, _, _ in cases}
        for r in range(args.rounds):
            order = cases if r % 2 == 0 else list(reversed(cases))
            for name, backend, ops in order:
                backend.clear()
                results[name].append(run_round(name, backend, host, ops, args.pages, f"{r:02x}"))
        ref_set = statistics.median(x[0] for x in results[cases[0][0]])
        ref_get = statistics.median(x[1] for x in results[cases[0][0]])
        print(
            f"{'backend':<36} {'set pages/s':>12} {'get pages/s':>12} {'set x':>6} {'get x':>6} {'bytes checked':>15}"
        )
        for name, _, _ in cases:
            s = statistics.median(x[0] for x in results[name])
            g = statistics.median(x[1] for x in results[name])
            checked = sum(x[2] for x in results[name])
            print(
                f"{name:<36} {s:>12.0f} {g:>12.0f} {s / ref_set:>6.2f} {g / ref_get:>6.2f} {checked:>15,}"
            )
    finally:
        for _, backend, _ in cases[1:2]:
            backend.close()
        shutil.rmtree(parent, ignore_errors=True)


if __name__ == "__main__":
    main()
