"""Transfer throughput per (layout, io, direction, page size) against one contiguous copy of
the same bytes measured in the same run.

    python bench/transfer.py                      # CPU, 256 MiB per combination
    python bench/transfer.py --tokens 1024        # shrink (64 MiB with the default geometry)
    python bench/transfer.py --device cuda        # host<->GPU vs one contiguous pinned copy,
                                                  # then a bf16 matmul beside a load
    HICACHE_DIRECT_COPIES=loop python bench/transfer.py --device cuda --io direct
    HICACHE_KERNEL_COPIES=torch python bench/transfer.py --device cuda --io kernel

Slots are random whole pages on both sides (a fragmented pool: the worst realistic case).
Directions: `load` = every layer host->device, one layer at a time (the layer-wise primitive);
`loadall` = every layer in one move (what inline CPU streams run); `backup` = every layer
device->host in one move. Ratios are contiguous-copy time / transfer time (1.0 = as fast as one
memcpy of those bytes), transfer and reference run alternately `--reps` times: `best` = best
reference time / best transfer time; `paired` = median over reps of each back-to-back pair's
ratio (robust to a quiet or busy spell that favours one side's best).
The reference is torch's `copy_` on `torch.get_num_threads()` threads; the CPU engine uses its
own copy threads (`--copy-threads`; its default: 2 with the compiled row copier, `--numpy`
runs without it). On CUDA the reference is one contiguous pinned copy; direct io runs through
the issuer `HICACHE_DIRECT_COPIES` names (default: the first available, printed), kernel io
through the Triton copy kernel on `--transfer-sms` SMs (or torch index ops with
`HICACHE_KERNEL_COPIES=torch`). Then, per io, a bf16 matmul is timed alone and beside a load of
every layer on another stream, and the slowdown printed as a ratio (1.00 = undisturbed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# torch's OpenMP threads spin after every parallel region (the reference copy is one) and took
# the cores from the CPU engine's copy threads in the transfer timed next: per-layer page_first
# loads ran 28-35 ms after a reference copy instead of 18-22 ms. Passive waiting leaves the
# reference as fast and the transfers undisturbed (set OMP_WAIT_POLICY to override).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # run from a checkout without installing

from hicache.kernels import (
    DevicePool,
    HostPool,
    parse_geometry,
    plan_transfer,
    run_backup,
    run_load_all,
    run_load_layer,
)
from hicache.kernels.engines import CpuEngine, engine_for
from hicache.kernels.names import DEFAULT_TRANSFER_SMS

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def best_interleaved(reps: int, fn, reference, sync) -> tuple[float, float, float]:
    """Best time of `fn`, best time of `reference`, and the median over reps of the pair's
    ratio (reference time / fn time), run back to back so each pair sees the same machine. On
    a shared host the two bests can come from different moments (a quiet spell helps whichever
    ran in it); the paired median cancels that drift and ignores single outliers."""
    fn()  # untimed: the first few large moves of a process pay for fresh memory (glibc hands
    reference()  # out big planning arrays by mmap until its threshold adapts; 44-71 ms vs 16 ms)
    sync()
    times, refs = [], []
    for _ in range(reps):
        times.append(timed(fn, sync))
        refs.append(timed(reference, sync))
    return min(times), min(refs), statistics.median(r / t for r, t in zip(refs, times))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--geometry", default="mha:16:8:128:float16")
    parser.add_argument(
        "--tokens", type=int, default=4096, help="tokens per transfer (default: 256 MiB)"
    )
    parser.add_argument("--page-sizes", default="1,16,64")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--io", default="kernel,direct")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)"
    )
    parser.add_argument(
        "--copy-threads",
        type=int,
        default=0,
        help="CPU engine copy threads per move (0: its default)",
    )
    parser.add_argument(
        "--numpy", action="store_true", help="CPU engine without the compiled row copier"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--transfer-sms", type=int, default=DEFAULT_TRANSFER_SMS, help="CUDA kernel io's SMs"
    )
    parser.add_argument("--matmul", type=int, default=8192, help="CUDA: the matmul's n (0: none)")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    g = parse_geometry(args.geometry)
    device_kind = torch.device(args.device)
    nbytes = args.tokens * g.bytes_per_token
    sync = torch.cuda.synchronize if device_kind.type == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)

    def cpu_engine() -> CpuEngine:
        return CpuEngine(threads=args.copy_threads or None, native=False if args.numpy else None)

    copier = "n/a"
    if device_kind.type == "cpu":
        probe = cpu_engine()
        copier = f"{'compiled' if probe.native else 'numpy'} rows, {probe.threads} thread(s)"
    print(
        f"geometry {g.spec()}  tokens {args.tokens}  bytes {nbytes / 2**20:.0f} MiB  device {device_kind}  "
        f"torch threads {torch.get_num_threads()}  CPU copies: {copier}"
    )
    # reference: one contiguous copy of the same bytes (host->device and device->host on CUDA)
    pinned = device_kind.type == "cuda"
    host_ref = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev_ref = torch.ones(nbytes, dtype=torch.uint8, device=device_kind)
    copies = {
        "load": lambda: dev_ref.copy_(host_ref, non_blocking=True),
        "backup": lambda: host_ref.copy_(dev_ref, non_blocking=True),
        "loadall": lambda: dev_ref.copy_(host_ref, non_blocking=True),
    }
    print(
        "reference: one contiguous copy of the same bytes, timed alternately with every row (shared machines drift)"
    )
    if device_kind.type == "cuda":
        print_engine_paths(device_kind, args.transfer_sms)
    print(
        f"{'layout':<18} {'io':<7} {'dir':<7} {'page':>4} {'GB/s':>7} {'ref':>7} {'best':>6} {'paired':>6}"
    )
    for ps in [int(p) for p in args.page_sizes.split(",")]:
        device = DevicePool.allocate(g, args.tokens, ps, device=device_kind)
        for layout in args.layouts.split(","):
            if layout == "page_head" and g.kind == "mla":
                continue
            host = HostPool(device, 2 * args.tokens, layout)
            host.buffer.fill_(1)  # touch every page so the timing excludes first-touch faults
            pages = args.tokens // ps
            dev_slots = (
                (rng.permutation(pages)[:, None] * ps + np.arange(ps)).ravel().astype(np.int64)
            )
            host_slots = (
                (rng.choice(2 * pages, pages, replace=False)[:, None] * ps + np.arange(ps))
                .ravel()
                .astype(np.int64)
            )
            for io in args.io.split(","):
                engine = (
                    cpu_engine()
                    if device_kind.type == "cpu"
                    else engine_for(device_kind, transfer_sms=args.transfer_sms)
                )

                def load() -> None:
                    plan = plan_transfer(host, device, host_slots, dev_slots)
                    for layer in range(g.layers):
                        run_load_layer(plan, host, device, layer, io, engine)

                def load_all() -> None:
                    plan = plan_transfer(host, device, host_slots, dev_slots)
                    run_load_all(plan, host, device, io, engine)

                def back() -> None:
                    plan = plan_transfer(host, device, host_slots, dev_slots)
                    run_backup(plan, device, host, io, engine)

                for direction, fn in (("load", load), ("loadall", load_all), ("backup", back)):
                    seconds, reference, paired = best_interleaved(
                        args.reps, fn, copies[direction], sync
                    )
                    print(
                        f"{layout:<18} {io:<7} {direction:<7} {ps:>4} {nbytes / seconds / 1e9:>7.2f} "
                        f"{nbytes / reference / 1e9:>7.2f} {reference / seconds:>6.2f} {paired:>6.2f}",
                        flush=True,
                    )
            host = None  # free this pool before the next layout allocates its own
    if device_kind.type == "cpu" and not args.numpy and g.kind == "mha":
        print_bounds(g, nbytes, args.reps, copies["load"], cpu_engine().threads)
    if device_kind.type == "cuda" and args.matmul:
        for io in args.io.split(","):
            print_matmul_beside_load(g, args.tokens, io, args.transfer_sms, args.matmul, args.reps)


def print_engine_paths(device: torch.device, transfer_sms: int) -> None:
    """Which issuer direct io uses and which copies kernel io runs, with the reasons."""
    engine = engine_for(device, transfer_sms=transfer_sms)
    print(f"direct io: {getattr(engine.direct_issuer, 'name', 'python')} ({engine.issuer_reason})")
    print(f"kernel io: {engine.kernel_path} ({engine.kernel_reason}), transfer_sms {transfer_sms}")


def print_matmul_beside_load(
    g, tokens: int, io: str, transfer_sms: int, n: int, reps: int, page_size: int = 16
) -> None:
    """A bf16 n x n matmul's time alone and while loads of every layer of `tokens` tokens
    (random pages, page_first_direct for direct io, page_first for kernel io) run on another
    stream: the ratio is the matmul's slowdown. The loads are enqueued first, enough of them to
    outlast the matmuls, so the matmuls run beside copies throughout."""
    device_kind = torch.device("cuda")
    device = DevicePool.allocate(g, tokens, page_size, device=device_kind)
    host = HostPool(device, 2 * tokens, "page_first_direct" if io == "direct" else "page_first")
    host.buffer.fill_(1)
    rng = np.random.default_rng(1)
    pages = tokens // page_size
    dev_slots = (rng.permutation(pages)[:, None] * page_size + np.arange(page_size)).ravel()
    host_slots = (
        rng.choice(2 * pages, pages, replace=False)[:, None] * page_size + np.arange(page_size)
    ).ravel()
    plan = plan_transfer(host, device, host_slots.astype(np.int64), dev_slots.astype(np.int64))
    side = torch.cuda.Stream()
    # no stream of its own: the engine issues on the current stream, `side` inside `load`
    engine = engine_for(device_kind, transfer_sms=transfer_sms)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device_kind)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device_kind)
    out = torch.empty_like(a)

    def load(count: int) -> None:
        with torch.cuda.stream(side):
            for _ in range(count):
                run_load_all(plan, host, device, io, engine)

    def matmuls(count: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    matmuls(3)  # warm: cuBLAS picks its kernel, the load plans its copies
    load(1)
    torch.cuda.synchronize()
    one = matmuls(1)
    count = max(10, int(0.2 / max(one, 1e-6)))  # about 0.2 s of matmuls
    load_s = timed(lambda: load(1), torch.cuda.synchronize)
    alone, beside = [], []
    for _ in range(reps):
        alone.append(matmuls(count))
        load(int(alone[-1] / load_s * 1.5) + 2)  # enqueued before the matmuls: they overlap
        beside.append(matmuls(count))
        torch.cuda.synchronize()
    ratio = statistics.median(b / a for a, b in zip(alone, beside))
    print(
        f"matmul bf16 {n}x{n} beside {io} io loads of {tokens * g.bytes_per_token / 2**20:.0f} MiB "
        f"(page {page_size}, load {tokens * g.bytes_per_token / load_s / 1e9:.1f} GB/s): "
        f"{min(alone) * 1e3 / count:.2f} ms alone, {min(beside) * 1e3 / count:.2f} ms beside, "
        f"slowdown {ratio:.3f}x (median of {reps})",
        flush=True,
    )


def print_bounds(g, nbytes: int, reps: int, reference, threads: int) -> None:
    """What the memory system allows for a per-layer load's host access pattern, measured with
    nothing else in the way: `layers` passes over `nbytes` of host memory, pass `l` copying
    piece `l` of every block (the layer's piece of each token or head row) into a contiguous
    destination, with the compiled copier on the engine's threads. No planning, no random pages,
    no device-side scatter: an upper bound for the per-layer `load` rows."""
    from concurrent.futures import ThreadPoolExecutor

    from hicache.kernels.native.rowcopy import native_rows
    from hicache.kernels.pinning import cpu_bytes

    copier = native_rows()
    if copier is None:
        return
    item = g.dtype.itemsize
    patterns = {  # layout: bytes of one layer's piece; consecutive layers' pieces are adjacent
        "page_first": g.components * g.row_heads * g.row_dim * item,  # K+V of one token
        "page_head": g.row_dim * item,  # one head row of one token
    }
    pool = ThreadPoolExecutor(max(1, threads - 1))
    print(
        "bounds: one layer's pieces read from each block of host memory, per layer, nothing else "
        "(the per-layer load's access pattern alone)"
    )
    for layout, piece in patterns.items():
        layers, block = g.layers, g.layers * piece
        src = cpu_bytes(nbytes).numpy().reshape(-1, piece)
        dst = cpu_bytes(nbytes).numpy().reshape(-1, piece)
        src[:] = 1
        dst[:] = 1
        blocks = nbytes // block
        starts = np.arange(blocks, dtype=np.int64) * layers

        def one_pass(layer: int, lo: int, hi: int) -> None:
            rows = starts[lo:hi] + layer
            copier.copy(dst, src, None, layer * blocks + lo, rows, 0, hi - lo, streaming=True)

        def run() -> None:
            for layer in range(layers):
                cuts = [blocks * i // threads for i in range(threads + 1)]
                helping = [
                    pool.submit(one_pass, layer, cuts[i], cuts[i + 1]) for i in range(1, threads)
                ]
                one_pass(layer, cuts[0], cuts[1])
                for future in helping:
                    future.result()

        seconds, ref, paired = best_interleaved(reps, run, reference, lambda: None)
        print(
            f"{'bound ' + layout:<18} {piece:>5} B per {block >> 10:>3} KiB block    "
            f"{nbytes / seconds / 1e9:>7.2f} {nbytes / ref / 1e9:>7.2f} {ref / seconds:>6.2f} {paired:>6.2f}",
            flush=True,
        )
    pool.shutdown()


if __name__ == "__main__":
    main()
