"""How fast a host pool's memory becomes usable: the pool's own allocation (an exact-size
mapping first-touched by several threads, then registered with cudaHostRegister) against
torch's pinned allocator for the same bytes, timed alternately in the same run.

    python bench/pinning.py                 # 4 GiB; with CUDA: pinned, against torch's
    python bench/pinning.py --gib 26.8      # the Llama-3-8B host pool of docs/benchmarks.md
    python bench/pinning.py --gib 1 --reps 5

Without CUDA nothing can be pinned: it measures the first-touch part alone (the pool's threads
against a single thread touching the same mapping) and says so. Each allocation is freed
before the next (torch's cached pinned blocks are emptied), so every rep faults fresh memory.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from hicache.kernels.huge_pages import max_touch_threads
from hicache.kernels.pinning import host_memory


def timed(make: Callable[[], object]) -> float:
    start = time.perf_counter()
    made = make()
    seconds = time.perf_counter() - start
    del made
    gc.collect()
    empty = getattr(torch._C, "_host_emptyCache", None)  # torch's cached pinned blocks
    if empty is not None and torch.cuda.is_available():
        empty()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=4.0, help="bytes to allocate, in GiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="touch threads (0: the default)")
    args = parser.parse_args()
    nbytes = int(args.gib * (1 << 30)) // 4096 * 4096
    threads = args.threads or max_touch_threads()
    cuda = torch.cuda.is_available()
    if cuda:
        what = "pool (mmap + touch on threads + cudaHostRegister) vs torch.empty(pin_memory=True)"

        def pool() -> object:
            memory = host_memory(nbytes, pin=True, threads=threads)
            if memory.pinning != "registered":
                raise SystemExit(f"the pool's memory was not registered: {memory.pinning}")
            return memory

        def reference() -> object:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    else:
        what = (
            "no CUDA here: first touch alone, the pool's threads vs a single thread touching "
            "the same kind of mapping (nothing is pinned)"
        )

        def pool() -> object:
            return host_memory(nbytes, threads=threads)

        def reference() -> object:
            return host_memory(nbytes, threads=1)

    print(f"{nbytes / 1e9:.2f} GB, {threads} touch thread(s) asked; {what}")
    pool_times, ref_times = [], []
    for _ in range(args.reps):
        pool_times.append(timed(pool))
        ref_times.append(timed(reference))
    best, ref = min(pool_times), min(ref_times)
    paired = statistics.median(r / p for r, p in zip(ref_times, pool_times))
    print(f"{'':<10} {'best s':>8} {'GB/s':>7}")
    print(f"{'pool':<10} {best:>8.3f} {nbytes / best / 1e9:>7.2f}")
    print(f"{'reference':<10} {ref:>8.3f} {nbytes / ref / 1e9:>7.2f}")
    print(f"ratio (reference time / pool time): best {ref / best:.2f}, paired median {paired:.2f}")


if __name__ == "__main__":
    main()
