"""The file store under a size cap, replaying the trace: how full the directory gets, with one
writer or several sharing it.

Runs `--writers` `hicache replay` processes at once on one `file:` store in a fresh directory
with `--storage-max-bytes`, the same model id (so one namespace directory), each on other
tokens (`--block-tokens` 512, 513, 514, ...: other page hashes), while this process samples
the namespace directory's bytes on disk (value and temporary files, in whole blocks as the
store counts them) every `--every` seconds. Prints the cap, the largest sample, each store's
own peak, what the directory holds at the end, the evictions and the hit rates; exits 1 if a
sample went above the bound docs/backends.md states for P writers: cap + (P - 1) x (0.1 x cap
+ one batch), plus one batch (`--batch-bytes`) in flight per writer.

Run: python bench/file_store_cap.py [--cap 64MiB] [--writers 3] [--limit N] [--every 0.05]
     [-- REPLAY FLAGS]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hicache.backends.mooncake.spec import parse_size


def tree_bytes(root: str) -> int:
    """Bytes the files under `root` take, in whole filesystem blocks."""
    try:
        block = os.statvfs(root).f_frsize
    except OSError:
        return 0
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                size = os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue  # evicted or renamed while we looked
            total += -(-size // block) * block
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", default="64MiB")
    parser.add_argument("--writers", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--every", type=float, default=0.05, help="seconds between samples")
    parser.add_argument(
        "--batch-bytes",
        default="2MiB",
        help="one upload batch: the allowed overshoot (128 pages of the replay's 16 KiB pages)",
    )
    args, replay_flags = parser.parse_known_args()
    cap, batch = parse_size(args.cap, "--cap"), parse_size(args.batch_bytes, "--batch-bytes")
    writers = args.writers
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    hicache = [sys.executable, "-m", "hicache.cli.main"]
    with tempfile.TemporaryDirectory(prefix="hicache-cap-", dir=shm) as tmp:
        store = os.path.join(tmp, "store")
        procs, outs = [], []
        for w in range(writers):
            out = os.path.join(tmp, f"summary{w}.json")
            flags = ["replay", "--storage", f"file:{store}", "--storage-max-bytes", str(cap)]
            flags += ["--block-tokens", str(512 + w), "--json", out, "--quiet", *replay_flags]
            if args.limit is not None:
                flags += ["--limit", str(args.limit)]
            procs.append(subprocess.Popen([*hicache, *flags], stdout=subprocess.DEVNULL))
            outs.append(out)
        samples: list[int] = []
        while any(p.poll() is None for p in procs):
            samples.append(tree_bytes(store))
            time.sleep(args.every)  # sampling period of a measurement, not a test's timing
        rcs = [p.wait() for p in procs]
        final = tree_bytes(store)
        summaries = []
        for out in outs:
            with open(out, encoding="utf-8") as f:
                summaries.append(json.load(f))
    worst = max(samples, default=final)
    bound = cap + (writers - 1) * (cap // 10 + batch) + writers * batch
    print(f"cap                 {cap:,} B, {writers} writer(s)")
    print(f"largest sample      {worst:,} B  ({len(samples)} samples, every {args.every} s)")
    print(f"at the end          {final:,} B on disk")
    for w, s in enumerate(summaries):
        st = s["storage_stats"]
        l3 = s["hit_tokens"]["storage"] / max(s["input_tokens"], 1)
        print(
            f"writer {w}: peak {st['peak_stored_bytes']:,} B, evictions {st['evictions']:,}, "
            f"rescans {st.get('rescans', 0)}, written {st['bytes_written']:,} B, "
            f"hit rate {s['hit_rate']:.4f} (L3 {l3:.4f}), errors {st.get('errors', 0)}, "
            f"corrupt {st.get('corrupt', 0)}"
        )
    ok = worst <= bound and final <= bound
    print(
        f"within cap + (P - 1) x (0.1 x cap + batch) + P x batch ({bound:,} B): {'yes' if ok else 'NO'}"
    )
    return 0 if ok and not any(rcs) else 1


if __name__ == "__main__":
    sys.exit(main())
