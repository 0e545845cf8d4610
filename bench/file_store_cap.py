"""The file store under a size cap, replaying the trace: how full the directory gets.

Runs `hicache replay` (same flags as the command, in this process) on a `file:` store in a
fresh directory with `--storage-max-bytes`, while a thread samples the namespace directory's
bytes on disk (value files and temporary files) every `--every` seconds. Prints the cap, the
largest sample, the store's own peak (`peak_stored_bytes`: indexed bytes plus writes in
flight), what it holds at the end, the evictions and the hit rates; exits 1 if a sample went
above cap + one upload batch (`--batch-bytes`).

Run: python bench/file_store_cap.py [--cap 64MiB] [--limit N] [--every 0.05] [-- REPLAY FLAGS]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hicache.backends.mooncake.spec import parse_size
from hicache.cli.main import main as hicache_main


def tree_bytes(root: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass  # evicted or renamed while we looked
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", default="64MiB")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--every", type=float, default=0.05, help="seconds between samples")
    parser.add_argument(
        "--batch-bytes",
        default="2MiB",
        help="one upload batch: the allowed overshoot (128 pages of the replay's 16 KiB pages)",
    )
    args, replay_flags = parser.parse_known_args()
    cap, batch = parse_size(args.cap, "--cap"), parse_size(args.batch_bytes, "--batch-bytes")
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="hicache-cap-", dir=shm) as tmp:
        store, summary = os.path.join(tmp, "store"), os.path.join(tmp, "summary.json")
        samples: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(args.every):
                samples.append(tree_bytes(store))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        flags = ["replay", "--storage", f"file:{store}", "--storage-max-bytes", str(cap)]
        flags += ["--json", summary, "--quiet", *replay_flags]
        if args.limit is not None:
            flags += ["--limit", str(args.limit)]
        rc = hicache_main(flags)
        stop.set()
        sampler.join()
        final = tree_bytes(store)
        with open(summary, encoding="utf-8") as f:
            s = json.load(f)
    st = s["storage_stats"]
    worst = max(samples, default=final)
    print(f"cap                 {cap:,} B")
    print(f"largest sample      {worst:,} B  ({len(samples)} samples, every {args.every} s)")
    print(f"store's own peak    {st['peak_stored_bytes']:,} B")
    print(f"at the end          {final:,} B on disk, {st['stored_bytes']:,} B indexed")
    print(f"evictions           {st['evictions']:,} values")
    print(f"bytes written       {st['bytes_written']:,} B")
    print(
        f"hit rate            {s['hit_rate']:.4f}  (L3 {s['hit_tokens']['storage'] / s['input_tokens']:.4f})"
    )
    ok = worst <= cap + batch and final <= cap + batch
    print(f"within cap + one batch ({cap + batch:,} B): {'yes' if ok else 'NO'}")
    return 0 if ok and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
