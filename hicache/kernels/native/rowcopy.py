"""The compiled row copier (rowcopy.c): its calls, bound through ctypes, and its loading (built
on first use by build.py, cached); the CPU engine falls back to numpy row copies without it.

Why compiled: a transfer between a device pool and a page-first host layout is a gather of
short rows (one head row of 256 B to one token of 2-32 KiB per layer); numpy moves them one
`memmove` each, which measured at a third to a half of a plain memcpy of the same bytes here
(docs/benchmarks.md "Transfers"). The C loop copies each row with inline vector moves and
streams large transfers past the cache.

Environment (`HICACHE_NATIVE`, `HICACHE_CACHE_DIR`, `CC`): build.py.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hicache.kernels.native.addresses import I64P, data_address, int64_address, int64_pointer
from hicache.kernels.native.build import (
    build_library,
    cached_library,
    disabled,
)

SOURCE = Path(__file__).with_name("rowcopy.c")
ABI = 6
_FLAGS = ["-O3", "-shared", "-fPIC", "-pthread"]


@dataclass(frozen=True, slots=True)
class NativeRows:
    """The loaded library; `path` is the shared object it came from."""

    path: Path
    _copy: Callable[..., int]  # ctypes foreign functions, their argtypes set by `_load`
    _copy_pages: Callable[..., int]
    _slot_pages: Callable[..., int]
    _u32_ids: Callable[..., int]
    _u32_same: Callable[..., int]
    _ledger_free: Callable[..., int]
    _ledger_alloc: Callable[..., None]
    _copier_start: Callable[..., int | None]
    _copier_submit: Callable[..., int]
    _copy_done: Callable[..., int]
    _copier_stop: Callable[..., None]

    def copy(
        self,
        dst: np.ndarray,
        src: np.ndarray,
        dst_rows: np.ndarray | None,
        dst_first: int,
        src_rows: np.ndarray | None,
        src_first: int,
        n: int,
        *,
        streaming: bool,
    ) -> None:
        """Copy `n` rows from `src` to `dst` (C-contiguous (rows, row) arrays of one itemsize
        and row length): row i from `src_rows[i]` (or `src_first + i` when None) to
        `dst_rows[i]` (or `dst_first + i`). Row tables are int64 and at least `n` long.
        `streaming`: non-temporal stores (for transfers much larger than the cache). Releases
        the GIL. Mutates `dst`; IndexError (after copying every in-range row) if any row is
        out of range."""
        row_bytes = dst.shape[1] * dst.itemsize
        if row_bytes != src.shape[1] * src.itemsize:
            raise ValueError(
                f"row lengths differ: {row_bytes} and {src.shape[1] * src.itemsize} bytes"
            )
        skipped = self._copy(
            dst.ctypes.data,
            dst.shape[0],
            src.ctypes.data,
            src.shape[0],
            int64_pointer(dst_rows, n),
            dst_first,
            int64_pointer(src_rows, n),
            src_first,
            n,
            row_bytes,
            int(streaming),
        )
        if skipped:
            raise IndexError(
                f"{skipped} of {n} row pairs out of range (dst rows {dst.shape[0]}, "
                f"src rows {src.shape[0]})"
            )

    def copy_pages(
        self,
        dst: np.ndarray,
        src: np.ndarray,
        dst_pages: np.ndarray,
        dst_page_rows: int,
        src_pages: np.ndarray,
        src_page_rows: int,
        runs: PageRuns,
        *,
        streaming: bool,
        dst_address: int | None = None,
        src_address: int | None = None,
    ) -> None:
        """For each page pair i and run r: rows `dst_pages[i] * dst_page_rows + runs.dst[r] + k`
        of `dst` <- `src_pages[i] * src_page_rows + runs.src[r] + k` of `src`, k < runs.len[r]
        (C-contiguous (rows, row) arrays of one row length; page arrays int64, equally long).
        No per-row table: the runs are one page's pattern. Releases the GIL. Mutates `dst`;
        IndexError (after copying every page in range) if a page's rows fall out of range.
        `dst_address` / `src_address`: the arrays' data addresses where the caller keeps them
        (taking one costs about as much as copying a page)."""
        args = page_args(
            dst, src, dst_pages, dst_page_rows, src_pages, src_page_rows, runs, streaming,
            dst_address, src_address,
        )  # fmt: skip
        skipped = self._copy_pages(*args)
        if skipped:
            rows = int(dst_pages.size) * runs.rows
            raise page_error(skipped, rows, dst.shape[0], src.shape[0])

    def slot_pages(self, slots: np.ndarray, page_size: int, size: int) -> np.ndarray | None:
        """The page numbers of `slots` (1-D C-contiguous int64) when they are whole aligned
        pages of `page_size` inside [0, size), no page twice; None otherwise (the caller
        finds and names the problem). One pass, no temporaries: the checks every transfer
        and ledger free make of the slots they are given."""
        n = int(slots.size)
        if page_size <= 0 or n % page_size:
            return None
        pages = np.empty(n // page_size, dtype=np.int64)
        bad = self._slot_pages(
            int64_address(slots, n),
            n,
            page_size,
            size,
            _marks(size // page_size),
            data_address(pages),
        )
        return None if bad else pages

    def u32_ids(self, ids: np.ndarray) -> np.ndarray | None:
        """Token ids (1-D C-contiguous int64) as a new uint32 array, or None if one is outside
        [0, 2**32) (the caller names it)."""
        n = int(ids.size)
        out = np.empty(n, dtype=np.uint32)
        bad = self._u32_ids(int64_address(ids, n), n, data_address(out))
        return out if bad < 0 else None

    def u32_same(self, ids: np.ndarray, have: np.ndarray) -> bool:
        """Whether token ids (1-D C-contiguous int64) equal `have` (1-D C-contiguous uint32 of
        the same length) id by id, without converting them."""
        n = int(ids.size)
        if have.dtype != np.uint32 or have.size != n or not have.flags.c_contiguous:
            raise ValueError("u32_same: `have` must be C-contiguous uint32 of the ids' length")
        return bool(self._u32_same(int64_address(ids, n), n, data_address(have)))

    def ledger_free(
        self,
        slots: np.ndarray,
        page_size: int,
        size: int,
        held: np.ndarray,
        free_pages: np.ndarray,
        top: int,
    ) -> int:
        """A slot ledger's free in one pass: `slots` (1-D C-contiguous int64, whole aligned
        pages in [0, size), each page held (`held`: bool per page) and listed once) pushed on
        the stack `free_pages` above `top`, reversed, their pages no longer held. The new top,
        or -1 with nothing changed (the caller names the problem)."""
        n = int(slots.size)
        return int(
            self._ledger_free(
                int64_address(slots, n),
                n,
                page_size,
                size,
                data_address(held),
                data_address(free_pages),
                top,
            )
        )

    def ledger_alloc(
        self, free_pages: np.ndarray, top: int, count: int, page_size: int, held: np.ndarray
    ) -> np.ndarray:
        """A slot ledger's alloc in one pass: the slots of the `count` pages below `top` of
        the stack `free_pages` (top first), marked held. The caller checked `count <= top`."""
        out = np.empty(count * page_size, dtype=np.int64)
        self._ledger_alloc(
            data_address(free_pages), top, count, page_size, data_address(held), data_address(out)
        )
        return out


def page_args(
    dst: np.ndarray,
    src: np.ndarray,
    dst_pages: np.ndarray,
    dst_page_rows: int,
    src_pages: np.ndarray,
    src_page_rows: int,
    runs: PageRuns,
    streaming: bool,
    dst_address: int | None,
    src_address: int | None,
) -> tuple[int, ...]:
    """`hicache_copy_pages`'s arguments for `NativeRows.copy_pages` (which says what they
    mean), checked: ValueError for rows of two lengths or page arrays of two."""
    row_bytes = dst.shape[1] * dst.itemsize
    if row_bytes != src.shape[1] * src.itemsize:
        raise ValueError(f"row lengths differ: {row_bytes} and {src.shape[1] * src.itemsize} bytes")
    n = int(dst_pages.size)
    if src_pages.size != n:
        raise ValueError(f"{n} destination pages but {src_pages.size} source pages")
    run_dst, run_src, run_len, prefetch = runs._addresses
    return (
        data_address(dst) if dst_address is None else dst_address,
        dst.shape[0],
        data_address(src) if src_address is None else src_address,
        src.shape[0],
        int64_address(dst_pages, n),
        dst_page_rows,
        int64_address(src_pages, n),
        src_page_rows,
        n,
        run_dst,
        run_src,
        run_len,
        runs.count,
        row_bytes,
        prefetch,
        int(runs.prefetch.size),
        int(streaming),
    )


def page_error(skipped: int, rows: int, dst_rows: int, src_rows: int) -> IndexError:
    """What a page copy that skipped `skipped` of its `rows` row pairs raises (the grids
    having `dst_rows` and `src_rows` rows)."""
    return IndexError(
        f"{skipped} of {rows} row pairs out of range (dst rows {dst_rows}, src rows {src_rows})"
    )


class PageRuns:
    """One page's row pattern for `NativeRows.copy_pages`: runs of `len[r]` rows from
    `src[r]` to `dst[r]` (rows relative to the page's first row), and `prefetch`, byte offsets
    of the source lines a page reads (touched a few pages ahead). Kept as read-only int64
    arrays with their addresses taken once (a numpy `.ctypes` lookup costs microseconds)."""

    __slots__ = ("dst", "src", "len", "prefetch", "count", "rows", "_addresses")

    def __init__(
        self, dst: np.ndarray, src: np.ndarray, length: np.ndarray, prefetch: np.ndarray
    ) -> None:
        arrays = [np.array(a, dtype=np.int64, copy=True) for a in (dst, src, length, prefetch)]
        if not arrays[0].size == arrays[1].size == arrays[2].size or arrays[2].ndim != 1:
            raise ValueError("page runs: dst, src and len must be 1-D and equally long")
        for a in arrays:
            a.flags.writeable = False
        self.dst, self.src, self.len, self.prefetch = arrays
        self.count = int(self.len.size)
        self.rows = int(self.len.sum())
        self._addresses = tuple(data_address(a) for a in arrays)


_SCRATCH = threading.local()


def _marks(count: int) -> int:
    """The address of this thread's zeroed mark buffer of at least `count` bytes (the copier's
    page check leaves it zeroed), made once per thread and size instead of once per check."""
    buffers: dict[int, np.ndarray] | None = getattr(_SCRATCH, "marks", None)
    if buffers is None:
        buffers = _SCRATCH.marks = {}
    buffer = buffers.get(count)
    if buffer is None:
        if len(buffers) >= 16:
            buffers.clear()
        buffer = buffers[count] = np.zeros(max(count, 1), dtype=np.uint8)
    return data_address(buffer)


def library_path() -> Path:
    """Where the row copier for this source, compiler and machine lives (built or not)."""
    return cached_library("rowcopy", SOURCE, _FLAGS)


def _bind(lib: ctypes.CDLL, name: str, restype: Any, *argtypes: Any) -> Any:
    """`lib.name` with its result and argument types set (a ctypes foreign function)."""
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


def _load(path: Path) -> NativeRows:
    lib = ctypes.CDLL(str(path))  # CDLL (not PyDLL): calls release the GIL
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    abi = _bind(lib, "hicache_rowcopy_abi", i64)()
    if abi != ABI:
        raise OSError(f"{path} has ABI {abi}, expected {ABI}")
    copy = _bind(
        lib, "hicache_copy_rows", i64,
        ptr, i64, ptr, i64, I64P, i64, I64P, i64, i64, i64, ctypes.c_int,
    )  # fmt: skip
    # Addresses as plain ints (c_void_p): the page loop is called per transfer, and building
    # ctypes pointer objects for its tables cost more than the checks and copies of a page.
    pages = _bind(
        lib, "hicache_copy_pages", i64,
        ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, i64,
        ctypes.c_int,
    )  # fmt: skip
    check = _bind(lib, "hicache_slot_pages", i64, ptr, i64, i64, i64, ptr, ptr)
    ids = _bind(lib, "hicache_u32_ids", i64, ptr, i64, ptr)
    same = _bind(lib, "hicache_u32_same", i64, ptr, i64, ptr)
    free = _bind(lib, "hicache_ledger_free", i64, ptr, i64, i64, i64, ptr, ptr, i64)
    alloc = _bind(lib, "hicache_ledger_alloc", None, ptr, i64, i64, i64, ptr, ptr)
    start = _bind(lib, "hicache_copier_start", ptr, i64)
    submit = _bind(
        lib, "hicache_copier_submit", i64,
        ptr, ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, i64,
        ctypes.c_int, ptr,
    )  # fmt: skip
    done = _bind(lib, "hicache_copy_done", i64, ptr)
    stop = _bind(lib, "hicache_copier_stop", None, ptr)
    return NativeRows(path, copy, pages, check, ids, same, free, alloc, start, submit, done, stop)


@functools.cache
def _native() -> tuple[NativeRows | None, str | None]:
    if disabled():
        return None, "disabled by HICACHE_NATIVE"
    try:
        path = library_path()
        if not path.exists():
            build_library(SOURCE, path, _FLAGS)
        return _load(path), None
    except (
        OSError,
        subprocess.SubprocessError,
        ValueError,
    ) as exc:  # no compiler, read-only cache, ...
        return None, f"{type(exc).__name__}: {exc}"


def native_rows() -> NativeRows | None:
    """The compiled row copier, built on the first call of the process; None where it cannot
    be (see `unavailable_reason`)."""
    return _native()[0]


def unavailable_reason() -> str | None:
    """Why `native_rows()` is None (compiler missing or failing, disabled...), else None."""
    return _native()[1]


def u32_ids(ids: np.ndarray) -> np.ndarray | None:
    """`NativeRows.u32_ids` of the compiled copier (built on first use), or None where it is
    not built or an id is out of range: the radix tree's key codec takes it as its converter
    and falls back to numpy on None."""
    native = native_rows()
    return None if native is None else native.u32_ids(ids)
