"""Transfer throughput per (layout, io, direction, page size) against one contiguous copy of
the same bytes measured in the same run.

    python bench/transfer.py                      # CPU, 256 MiB per combination
    python bench/transfer.py --tokens 1024        # shrink (64 MiB with the default geometry)
    python bench/transfer.py --device cuda        # host<->GPU vs one contiguous pinned copy

Slots are random whole pages on both sides (a fragmented pool: the worst realistic case).
`ratio` = contiguous-copy time / transfer time (1.0 = as fast as one memcpy of those bytes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
import time

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hicache.kernels import DevicePool, HostPool, parse_geometry, plan_transfer, run_backup, run_load_layer
from hicache.kernels.engines import engine_for

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def best_of(reps: int, fn, sync) -> float:
    best = float("inf")
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", default="mha:16:8:128:float16")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per transfer (default: 256 MiB)")
    parser.add_argument("--page-sizes", default="1,16,64")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--io", default="kernel,direct")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    g = parse_geometry(args.geometry)
    device_kind = torch.device(args.device)
    nbytes = args.tokens * g.bytes_per_token
    sync = torch.cuda.synchronize if device_kind.type == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    print(f"geometry {g.spec()}  tokens {args.tokens}  bytes {nbytes / 2**20:.0f} MiB  device {device_kind}  "
          f"torch threads {torch.get_num_threads()}")
    # reference: one contiguous copy of the same bytes (host->device and device->host on CUDA)
    pinned = device_kind.type == "cuda"
    host_ref = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev_ref = torch.ones(nbytes, dtype=torch.uint8, device=device_kind)
    copies = {
        "load": lambda: dev_ref.copy_(host_ref, non_blocking=True),
        "backup": lambda: host_ref.copy_(dev_ref, non_blocking=True),
    }
    print("reference: one contiguous copy of the same bytes, re-measured beside every row (shared machines drift)")
    print(f"{'layout':<18} {'io':<7} {'dir':<7} {'page':>4} {'GB/s':>7} {'ref':>7} {'ratio':>6}")
    for ps in [int(p) for p in args.page_sizes.split(",")]:
        device = DevicePool.allocate(g, args.tokens, ps, device=device_kind)
        for layout in args.layouts.split(","):
            if layout == "page_head" and g.kind == "mla":
                continue
            host = HostPool(device, 2 * args.tokens, layout)
            host.buffer.fill_(1)  # touch every page so the timing excludes first-touch faults
            pages = args.tokens // ps
            dev_slots = (rng.permutation(pages)[:, None] * ps + np.arange(ps)).ravel().astype(np.int64)
            host_slots = (rng.choice(2 * pages, pages, replace=False)[:, None] * ps + np.arange(ps)).ravel().astype(np.int64)
            for io in args.io.split(","):
                engine = engine_for(device_kind)

                def load() -> None:
                    plan = plan_transfer(host, device, host_slots, dev_slots)
                    for layer in range(g.layers):
                        run_load_layer(plan, host, device, layer, io, engine)

                def back() -> None:
                    plan = plan_transfer(host, device, host_slots, dev_slots)
                    run_backup(plan, device, host, io, engine)

                for direction, fn in (("load", load), ("backup", back)):
                    seconds = best_of(args.reps, fn, sync)
                    reference = best_of(args.reps, copies[direction], sync)
                    print(f"{layout:<18} {io:<7} {direction:<7} {ps:>4} {nbytes / seconds / 1e9:>7.2f} "
                          f"{nbytes / reference / 1e9:>7.2f} {reference / seconds:>6.2f}", flush=True)
            del host


if __name__ == "__main__":
    main()
