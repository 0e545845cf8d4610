"""The compiled row copier (rowcopy.c): built with the system C compiler on first use, cached,
and loaded through ctypes; the CPU engine falls back to numpy row copies without it.

Why compiled: a transfer between a device pool and a page-first host layout is a gather of
short rows (one head row of 256 B to one token of 2-32 KiB per layer); numpy moves them one
`memmove` each, which measured at a third to a half of a plain memcpy of the same bytes here
(docs/benchmarks.md "Transfers"). The C loop copies each row with inline vector moves and
streams large transfers past the cache.

Environment:
- `HICACHE_NATIVE=0` disables it (numpy row copies only);
- `HICACHE_CACHE_DIR` is where the built library is kept (default `$XDG_CACHE_HOME/hicache`,
  else `~/.cache/hicache`); the file name carries a hash of the source, the compiler command
  and the machine, so an edited source or another compiler builds anew;
- `CC` names the compiler (default `cc`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SOURCE = Path(__file__).with_name("rowcopy.c")
ABI = 2
_FLAGS = ["-O3", "-shared", "-fPIC"]
_COMPILE_SECONDS = 120

_I64P = ctypes.POINTER(ctypes.c_int64)


@dataclass(frozen=True, slots=True)
class NativeRows:
    """The loaded library; `path` is the shared object it came from."""

    path: Path
    _copy: Callable[..., int]  # a ctypes foreign function, its argtypes set by `_load`

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
            _rows(dst_rows, n),
            dst_first,
            _rows(src_rows, n),
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


def _rows(rows: np.ndarray | None, n: int) -> Any:  # a ctypes int64 pointer, or None
    if rows is None:
        return None
    if rows.dtype != np.int64 or rows.ndim != 1 or rows.size < n or not rows.flags.c_contiguous:
        raise ValueError(f"row table must be 1-D contiguous int64 with at least {n} entries")
    return rows.ctypes.data_as(_I64P)


def cache_dir() -> Path:
    explicit = os.environ.get("HICACHE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hicache"


def compiler() -> list[str]:
    """The C compiler command (`CC`, default `cc`)."""
    return shlex.split(os.environ.get("CC") or "cc")


def disabled() -> bool:
    """`HICACHE_NATIVE=0` (or false/no/off) turns every compiled helper off."""
    return os.environ.get("HICACHE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def cached_library(
    stem: str, source: Path, flags: list[str], *extra: str, suffix: str = ".so"
) -> Path:
    """Where the build of `source` with `flags` lives: the name carries a hash of the source,
    the compiler command, the machine and `extra` (say, the interpreter a module is for)."""
    digest = hashlib.sha256()
    digest.update(source.read_bytes())
    digest.update(" ".join(compiler() + flags).encode())
    digest.update(platform.machine().encode())
    for part in extra:
        digest.update(part.encode())
    return cache_dir() / f"{stem}-{digest.hexdigest()[:16]}{suffix}"


def build_library(source: Path, target: Path, flags: list[str]) -> None:
    """Compile `source` into a temporary file next to `target`, then rename: concurrent
    builders (test workers, TP ranks, worker threads) never load a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [*compiler(), *flags, "-o", tmp, str(source)],
            capture_output=True,
            text=True,
            timeout=_COMPILE_SECONDS,
            check=False,
        )
        if done.returncode != 0:
            raise OSError(
                f"{' '.join(compiler())} failed ({done.returncode}): {done.stderr.strip()[:500]}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path() -> Path:
    """Where the row copier for this source, compiler and machine lives (built or not)."""
    return cached_library("rowcopy", SOURCE, _FLAGS)


def _load(path: Path) -> NativeRows:
    lib = ctypes.CDLL(str(path))  # CDLL (not PyDLL): calls release the GIL
    lib.hicache_rowcopy_abi.restype = ctypes.c_int64
    if lib.hicache_rowcopy_abi() != ABI:
        raise OSError(f"{path} has ABI {lib.hicache_rowcopy_abi()}, expected {ABI}")
    copy = lib.hicache_copy_rows
    copy.restype = ctypes.c_int64
    copy.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        _I64P,
        ctypes.c_int64,
        _I64P,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    return NativeRows(path, copy)


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
