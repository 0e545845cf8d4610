"""Direct io on CUDA as a few driver calls: a transfer becomes one list of (destination,
source, size) copies, issued as one batched DMA where the driver has it.

The list (`copy_list`): every (layer, component) page view of a transfer is cut into the
pieces both sides hold contiguously (a whole page in `page_first_direct`, a token's heads in
`page_first`), one entry per page pair and piece, in host-page order; entries that continue
each other on both sides are merged, so a run of consecutive pages is one copy.

The issuers, chosen once per engine (`choose_issuer`; `HICACHE_DIRECT_COPIES` forces one):
- `batch`: `cuMemcpyBatchAsync` (driver >= 12.8), its entry point found through cuda-python's
  `cuGetProcAddress` and called through ctypes on the numpy arrays themselves: no per-copy
  Python. The 12.x entry point takes a `failIdx` out-argument; the 13.x one has none.
- `batch-python`: cuda-python's runtime `cudaMemcpyBatchAsync`, which takes Python lists
  (0.23 us a copy to convert, measured here: 30 ms for the 131,072 copies of a 256 MiB
  backup at page size 1, six times that backup's time at 55 GB/s); where `batch` is not found.
- `loop`: drivers without the batch call: a compiled loop (cudacopy.c, built on first use like
  the row copier) calling `cuMemcpyAsync` once per copy.
- none of them (no cuda-python driver entry points, no compiler): the engine copies run by run
  from Python (`CudaEngine.copy_run`).
Both batch calls refuse the legacy default stream: the engine issues on its own non-blocking
stream (cuda_engine.py).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hicache.kernels.native.build import disabled, load_library

ISSUERS = ("batch", "batch-python", "loop", "python")
"""What `HICACHE_DIRECT_COPIES` may name ("python": run-by-run copies from Python)."""

BATCH_VERSION_12 = 12080  # cuMemcpyBatchAsync appeared in CUDA 12.8 (with failIdx)
BATCH_VERSION_13 = 13000  # ... and lost failIdx in 13.0


@dataclass(frozen=True, slots=True)
class PieceLayout:
    """How one (dst, src) pair of page views is cut into copies: page `p` of a side starts at
    `base + p * page` bytes and holds pieces at `offsets` (bytes, int64) of `piece` bytes each,
    the same count and order on both sides."""

    dst_base: int
    dst_page: int
    dst_offsets: np.ndarray
    src_base: int
    src_page: int
    src_offsets: np.ndarray
    piece: int


def _contiguous_from(view: torch.Tensor) -> int:
    """The first dim d >= 1 such that dims d.. of `view` are one contiguous block."""
    expected, d = 1, view.dim()
    while d > 1 and view.stride(d - 1) == expected:
        expected *= view.shape[d - 1]
        d -= 1
    return d


def piece_layout(dst: torch.Tensor, src: torch.Tensor) -> PieceLayout:
    """The pieces of two equally shaped (pages, ...) views: the trailing dims contiguous on
    both sides make one piece, the dims before them (not the page dim) enumerate the pieces.
    Pure (reads only addresses, shapes and strides)."""
    if dst.shape[1:] != src.shape[1:] or dst.element_size() != src.element_size():
        raise ValueError(
            f"page views differ: {tuple(dst.shape)} of {dst.dtype} and "
            f"{tuple(src.shape)} of {src.dtype}"
        )
    size = dst.element_size()
    first = max(_contiguous_from(dst), _contiguous_from(src))
    piece = math.prod(dst.shape[first:]) * size

    def offsets(view: torch.Tensor) -> np.ndarray:
        out = np.zeros(1, dtype=np.int64)
        for n, stride in zip(view.shape[1:first], view.stride()[1:first]):
            out = (out[:, None] + np.arange(n, dtype=np.int64) * (stride * size)).ravel()
        return out

    return PieceLayout(
        dst.data_ptr(),
        dst.stride(0) * size,
        offsets(dst),
        src.data_ptr(),
        src.stride(0) * size,
        offsets(src),
        piece,
    )


def copy_list(
    layouts: list[PieceLayout], dst_pages: np.ndarray, src_pages: np.ndarray, order: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dsts, srcs, sizes) as uint64 arrays: for every layout, page pair `order[i]` and piece,
    one copy; then copies that continue the previous one on both sides merged into it. `order`
    is the page pairs' order (host page order, so runs of consecutive pages merge). Pure."""
    if not layouts or dst_pages.size == 0:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty
    dst_p, src_p = dst_pages[order], src_pages[order]
    first = layouts[0]
    alike = all(
        (lay.dst_page, lay.src_page, lay.piece) == (first.dst_page, first.src_page, first.piece)
        and np.array_equal(lay.dst_offsets, first.dst_offsets)
        and np.array_equal(lay.src_offsets, first.src_offsets)
        for lay in layouts[1:]
    )
    groups = [layouts] if alike else [[lay] for lay in layouts]  # views of one pattern at once
    dsts, srcs, sizes = [], [], []
    for group in groups:
        lay = group[0]
        dst_bases = np.array([g.dst_base for g in group], dtype=np.int64)
        src_bases = np.array([g.src_base for g in group], dtype=np.int64)
        d = (dst_p * lay.dst_page)[:, None] + lay.dst_offsets[None, :]  # (pages, pieces)
        s = (src_p * lay.src_page)[:, None] + lay.src_offsets[None, :]
        dsts.append((dst_bases[:, None] + d.ravel()[None, :]).ravel())  # (views, ...)
        srcs.append((src_bases[:, None] + s.ravel()[None, :]).ravel())
        sizes.append(np.full(dsts[-1].size, lay.piece, dtype=np.int64))
    dst, src, size = (
        (parts[0] if len(parts) == 1 else np.concatenate(parts)) for parts in (dsts, srcs, sizes)
    )
    follows = (dst[1:] == dst[:-1] + size[:-1]) & (src[1:] == src[:-1] + size[:-1])
    if follows.any():
        starts = np.concatenate(([0], np.flatnonzero(~follows) + 1))
        dst, src, size = dst[starts], src[starts], np.add.reduceat(size, starts)
    # int64 addresses and sizes are non-negative: the same bits as uint64, no copy
    return dst.view(np.uint64), src.view(np.uint64), size.view(np.uint64)


class Issuer(Protocol):
    """Enqueues a copy list on a stream (a raw `CUstream` handle, never 0)."""

    name: str

    def issue(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """Enqueue every copy (uint64 arrays, equally long, C-contiguous). Raises RuntimeError
        naming the driver's error (and the copy, where it says which) if it refuses."""
        ...


def _error_name(err: Any) -> str:
    return str(getattr(err, "name", err))


def _result_ok(result: Any) -> tuple[bool, Any]:
    err = result[0] if isinstance(result, tuple) else result
    return int(err) == 0, err


def _address(array: np.ndarray) -> int:
    return int(array.ctypes.data)


class DriverBatch:
    """`cuMemcpyBatchAsync` through its driver entry point, one call per copy list. `pfn`:
    the entry point's address; `with_fail_index`: the 12.x ABI (a `size_t *failIdx` before the
    stream); `attributes`: the address of one `CUmemcpyAttributes` (kept alive by `keep`)."""

    name = "batch"

    def __init__(self, pfn: int, with_fail_index: bool, attributes: int, keep: object) -> None:
        p, size = ctypes.c_void_p, ctypes.c_size_t
        head = [p, p, p, size, p, p, size]
        args = [*head, p, p] if with_fail_index else [*head, p]
        self._call = ctypes.CFUNCTYPE(ctypes.c_int, *args)(pfn)
        self.with_fail_index = with_fail_index
        self._attributes = attributes
        self._keep = keep
        self._index = np.zeros(1, dtype=np.uint64)  # attrsIdxs: the one attribute from copy 0
        self._fail = np.zeros(1, dtype=np.uint64)

    def issue(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        n = int(sizes.size)
        if n == 0:
            return
        head = (
            _address(dsts),
            _address(srcs),
            _address(sizes),
            n,
            self._attributes,
            _address(self._index),
            1,
        )
        if self.with_fail_index:
            self._fail[0] = np.uint64(2**64 - 1)
            status = self._call(*head, _address(self._fail), stream)
        else:
            status = self._call(*head, stream)
        if status != 0:
            where = ""
            if self.with_fail_index and int(self._fail[0]) < n:
                where = f" at copy {int(self._fail[0])} of {n}"
            raise RuntimeError(f"cuMemcpyBatchAsync failed{where}: CUresult {status}")


class RuntimeBatch:
    """cuda-python's runtime `cudaMemcpyBatchAsync` (lists of addresses). The 12.x binding
    returns `(err, failIdx)`, the 13.x one `(err,)`."""

    name = "batch-python"

    def __init__(self, runtime: Any) -> None:
        self._rt = runtime
        attributes = runtime.cudaMemcpyAttributes()
        attributes.srcAccessOrder = runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        attributes.flags = runtime.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
        self._attributes = attributes

    def issue(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        n = int(sizes.size)
        if n == 0:
            return
        rt = self._rt
        result = rt.cudaMemcpyBatchAsync(
            dsts.tolist(),
            srcs.tolist(),
            sizes.tolist(),
            n,
            [self._attributes],
            [0],
            1,
            rt.cudaStream_t(stream),
        )
        ok, err = _result_ok(result)
        if not ok:
            where = ""
            if isinstance(result, tuple) and len(result) > 1 and int(result[1]) < n:
                where = f" at copy {int(result[1])} of {n}"
            raise RuntimeError(f"cudaMemcpyBatchAsync failed{where}: {_error_name(err)}")


class CompiledLoop:
    """One `cuMemcpyAsync` per copy, issued by the compiled loop (cudacopy.c)."""

    name = "loop"

    def __init__(self, library: ctypes.CDLL, pfn: int) -> None:
        self._loop = library.hicache_copy_loop
        self._pfn = pfn
        self._error = np.zeros(1, dtype=np.int64)

    def issue(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        n = int(sizes.size)
        if n == 0:
            return
        failed = self._loop(
            self._pfn,
            _address(dsts),
            _address(srcs),
            _address(sizes),
            n,
            stream,
            _address(self._error),
        )
        if failed:
            raise RuntimeError(
                f"cuMemcpyAsync failed at copy {failed - 1} of {n}: CUresult {int(self._error[0])}"
            )


SOURCE = Path(__file__).with_name("cudacopy.c")
ABI = 1
_FLAGS = ["-O2", "-shared", "-fPIC"]


@functools.cache
def copy_loop_library() -> tuple[ctypes.CDLL | None, str | None]:
    """The compiled copy loop (built on first use, cached like the row copier), or None and
    why not."""
    if disabled():
        return None, "disabled by HICACHE_NATIVE"
    try:
        lib = load_library("cudacopy", SOURCE, _FLAGS, ABI)
        loop = lib.hicache_copy_loop
        loop.restype = ctypes.c_int64
        p = ctypes.c_void_p
        loop.argtypes = [p, p, p, p, ctypes.c_int64, p, p]
        return lib, None
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _proc(driver: Any, symbol: str, version: int) -> int:
    """The driver's entry point for `symbol` as of CUDA `version`, or 0."""
    result = driver.cuGetProcAddress(symbol.encode(), version, 0)
    ok, _ = _result_ok(result)
    return int(result[1]) if ok and result[1] else 0


def choose_issuer(
    prefer: str | None = None, *, driver: Any = None, runtime: Any = None
) -> tuple[Issuer | None, str]:
    """The issuer direct io uses on this machine and why (module docstring for the order);
    None means run-by-run copies from Python. `prefer` (default `HICACHE_DIRECT_COPIES`, else
    the first that works) forces one of `ISSUERS`: ValueError if it is unknown, RuntimeError if
    it is unavailable here. `driver` / `runtime`: cuda-python's modules, or stand-ins."""
    prefer = prefer or os.environ.get("HICACHE_DIRECT_COPIES") or None
    if prefer is not None and prefer not in ISSUERS:
        raise ValueError(f"unknown direct-copy issuer {prefer!r}; expected one of {list(ISSUERS)}")
    if prefer == "python":
        return None, "run-by-run copies from Python requested"
    reasons: list[str] = []
    try:
        if driver is None or runtime is None:
            from cuda.bindings import driver as cuda_driver
            from cuda.bindings import runtime as cuda_runtime

            driver = cuda_driver if driver is None else driver
            runtime = cuda_runtime if runtime is None else runtime
        result = driver.cuDriverGetVersion()
        ok, err = _result_ok(result)
        version = int(result[1]) if ok else 0
        if not ok:
            reasons.append(f"cuDriverGetVersion failed: {_error_name(err)}")
    except Exception as exc:  # noqa: BLE001 - no cuda-python, library or driver
        version = 0
        reasons.append(f"no driver: {type(exc).__name__}: {exc}")
    if prefer in (None, "batch") and version >= BATCH_VERSION_12:
        try:
            new = version >= BATCH_VERSION_13
            pfn = _proc(driver, "cuMemcpyBatchAsync", BATCH_VERSION_13 if new else BATCH_VERSION_12)
            if pfn:
                attributes = driver.CUmemcpyAttributes()
                order = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                attributes.srcAccessOrder = order
                attributes.flags = driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
                issuer = DriverBatch(pfn, not new, int(attributes.getPtr()), attributes)
                return issuer, f"cuMemcpyBatchAsync (driver {version}, one call per transfer)"
            reasons.append("cuGetProcAddress has no cuMemcpyBatchAsync")
        except Exception as exc:  # noqa: BLE001 - an entry point we cannot use: next option
            reasons.append(f"cuMemcpyBatchAsync: {type(exc).__name__}: {exc}")
    elif version:
        reasons.append(f"driver {version} has no cuMemcpyBatchAsync (needs {BATCH_VERSION_12})")
    if prefer in (None, "batch-python") and version >= BATCH_VERSION_12:
        if hasattr(runtime, "cudaMemcpyBatchAsync"):
            return RuntimeBatch(runtime), "cuda-python cudaMemcpyBatchAsync (lists of addresses)"
        reasons.append("cuda-python has no cudaMemcpyBatchAsync")
    if prefer in (None, "loop") and version:
        library, why = copy_loop_library()
        try:
            pfn = _proc(driver, "cuMemcpyAsync", version) if library is not None else 0
        except Exception as exc:  # noqa: BLE001
            pfn, why = 0, f"{type(exc).__name__}: {exc}"
        if library is not None and pfn:
            return CompiledLoop(library, pfn), "compiled cuMemcpyAsync loop (no batch call)"
        reasons.append(f"copy loop unavailable: {why or 'no cuMemcpyAsync entry point'}")
    if prefer is not None:
        raise RuntimeError(f"direct-copy issuer {prefer!r} unavailable: {'; '.join(reasons)}")
    return None, "run-by-run copies from Python: " + "; ".join(reasons)
