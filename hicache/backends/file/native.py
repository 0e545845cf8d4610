"""The file store's per-page I/O loops compiled (`io.py`'s read_value, write_value and
count_present, page for page, for a whole batch per call), built on first use like the row
copier (kernels/native/rowcopy.py) and used where it builds; io.py's Python loops otherwise.

Why: a page read or write is five or six system calls, and in Python every one of them gives up
the GIL and takes it back. With the event loop busy on the GIL, each take-back can wait for the
loop's switch interval, so the worker threads' throughput, and the prefetches waiting on them,
depended on how busy the loop was; and the Python around the calls held the GIL a few
microseconds per page. The compiled loop takes the GIL once per batch to read its arguments,
makes every call of the batch without it, and takes it once more to hand back the results.

It is a CPython extension module (fileio.c), compiled with the system C compiler
(`CC`, default `cc`) against this interpreter's headers into the row copier's cache directory
(`HICACHE_CACHE_DIR`, kernels/native/build.py), the file name carrying a hash of the source, the
compiler, the interpreter and the machine. `HICACHE_NATIVE=0` turns it off with the row copier.
Linux only (O_NOATIME, nanosecond timestamps); it needs isal's CRC-32 (`crc32_gzip_refl`,
the same CRC as framing.py's) and checks itself against framing.py at load.

It also checksums a batch of values (`checksums`, framing.py's batch form, which uses it): the
per-piece CRC-32 calls each need the GIL between pieces, so beside a thread that holds the GIL
for long stretches (NIXL's Python binding holds it while its plugin copies) they barely ran;
one call per batch needs it only to take the buffers and to hand back the results. For the
same reason it frames and unframes a batch of values in memory (`frame_values`,
`unframe_values`: header, copy and CRC-32, for simple.py's stores), the copies and checksums
made without the GIL, each step checksummed right after its copy, while in cache.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.util
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any

from hicache.backends.file.index import atime_ns_to_expiry
from hicache.backends.file.io import Expired, Read, read_value, write_value
from hicache.backends.framing import (
    FIXED_HEADER_SIZE,
    CorruptValue,
    checksum,
    decode_header,
    encode_header,
)
from hicache.kernels.native.build import build_library, cached_library, disabled

_NAME = "_hicache_file_io"
_ABI = 4
_FLAGS = ["-O2", "-shared", "-fPIC", "-pthread"]
_COMPILE_SECONDS = 120

# result codes of read_values (the C enum)
_READ, _ABSENT, _EXPIRED, _HEADER, _TRUNC_SIZE, _LENGTH, _TRUNC_READ, _CHECKSUM, _ERROR = range(9)

SOURCE = Path(__file__).with_name("fileio.c")


def expire_le(now: float) -> int:
    """The largest deadline E (integer nanoseconds) that reads as expired at `now` the way
    Python compares (`E / 10**9 <= now`, the division correctly rounded): the compiled loops
    compare integers, so they decide exactly as io.py does."""
    if not math.isfinite(now):
        raise ValueError(f"clock gave {now!r}")
    lo = math.floor(Fraction(now) * 10**9)  # lo / 10**9 <= now exactly, so rounded too
    hi = math.floor(Fraction(math.nextafter(now, math.inf)) * 10**9) + 1  # rounds above now
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mid / 10**9 <= now:
            lo = mid
        else:
            hi = mid
    return lo


class NativeFileIO:
    """The loaded module; each method is the batch form of its io.py function."""

    def __init__(self, module: ModuleType, path: Path) -> None:
        self.module = module
        self.path = path

    def write_values(self, jobs: Sequence[tuple[Any, ...]]) -> list[tuple[int, int] | OSError]:
        """`write_value` of each job (same tuples, same results)."""
        out: list[tuple[int, int] | OSError] = []
        for job, (a, b) in zip(jobs, self.module.write_values(list(jobs))):
            if a >= 0:
                out.append((a, b))
                continue
            err = -a  # b: 1 failed on the temporary file, 2 on the rename, 0 elsewhere
            if b == 1:
                out.append(OSError(err, os.strerror(err), job[2]))
            elif b == 2:
                out.append(OSError(err, os.strerror(err), job[2], None, job[1]))
            else:
                out.append(OSError(err, os.strerror(err)))
        return out

    def read_values(self, jobs: Sequence[tuple[Any, ...]]) -> list[Any]:
        """`read_value` of each job (same tuples, same results). The jobs share one `now`."""
        if not jobs:
            return []
        limit = expire_le(jobs[0][3])
        out: list[Any] = []
        for job, result in zip(jobs, self.module.read_values(list(jobs), limit)):
            out.append(_read_result(job, result))
        return out

    def count_present(self, paths: list[str], now: float) -> int:
        """`count_present`, the same count."""
        return int(self.module.count_present(paths, expire_le(now)))

    def checksums(self, values: Sequence[Sequence[memoryview | bytes]]) -> list[int]:
        """The CRC-32 of each value (the concatenation of its buffers), framing.checksum's
        result, with the GIL released once for the whole batch."""
        crcs: list[int] = self.module.crc32_values(values)
        return crcs

    def frame_values(
        self, keys: Sequence[str], pages: Sequence[Sequence[memoryview | bytes]]
    ) -> list[bytes]:
        """framing.py's value of each page (header, then the pieces joined): one call per
        batch, the copies and checksums made with the GIL released."""
        values: list[bytes] = self.module.frame_values(list(keys), list(pages))
        return values

    def unframe_values(
        self,
        keys: Sequence[str],
        values: Sequence[bytes | bytearray | memoryview | None],
        pages: Sequence[Sequence[memoryview]],
    ) -> list[int | CorruptValue | None]:
        """Each value (None: a miss) checked as its key's and copied into its page: the
        payload bytes, None for a miss, or the CorruptValue framing.py's checks raise (the
        page may then hold part of the value). One call per batch, the GIL released."""
        out: list[int | CorruptValue | None] = []
        results = self.module.unframe_values(list(keys), list(values), list(pages))
        for key, value, result in zip(keys, values, results):
            if result is None:
                out.append(None)
                continue
            code, a, b = result
            if code == _READ:
                out.append(a)
            elif code == _HEADER:
                out.append(_header_fault(memoryview(value).cast("B"), key))  # type: ignore[arg-type]
            elif code == _TRUNC_SIZE:
                out.append(CorruptValue("truncated", f"{a} payload bytes, header says {b}"))
            elif code == _LENGTH:
                out.append(CorruptValue("length", f"value holds {a} bytes, page has {b}"))
            elif code == _CHECKSUM:
                out.append(CorruptValue("checksum", f"checksum mismatch for {key!r}"))
            else:
                raise RuntimeError(f"unknown result code {code}")
        return out

    def checksums_started(self, values: Sequence[Sequence[memoryview | bytes]]) -> StartedChecksums:
        """`checksums` computed on a thread of the module's own (one that never takes the GIL),
        returned at once; `result` computes the values the thread has not started yet (so a
        thread that got no core costs no more than computing them then), then waits for it.
        The values' buffers are held until `result`."""
        return StartedChecksums(self.module.crc32_finish, self.module.crc32_start(values))


class StartedChecksums:
    """Checksums being computed on a native thread; `result` waits for them (GIL released)."""

    __slots__ = ("_finish", "_job")

    def __init__(self, finish: Any, job: Any) -> None:
        self._finish = finish
        self._job = job

    def result(self) -> list[int]:
        crcs: list[int] = self._finish(self._job)
        return crcs


def _header_fault(value: memoryview | bytes, key: str) -> CorruptValue:
    """Why framing.decode_header refuses `value` as `key`'s (the compiled check agreed it does)."""
    try:
        decode_header(value, key)
    except CorruptValue as exc:
        return exc
    return CorruptValue("truncated", "header unreadable")  # not reached: C agreed


def _read_result(job: tuple[Any, ...], result: Any) -> Any:
    if result is None:
        return None
    key = job[0]
    code = result[0]
    if code == _READ:
        return Read(result[1], result[2], atime_ns_to_expiry(result[3], result[4]))
    if code == _EXPIRED:
        return Expired(result[1])
    if code == _ERROR:
        if result[2]:  # the open failed: named like os.open's error
            return OSError(result[1], os.strerror(result[1]), job[1])
        return OSError(result[1], os.strerror(result[1]))
    if code == _HEADER:
        return _header_fault(result[1], key)
    if code == _TRUNC_SIZE:
        return CorruptValue("truncated", f"{result[1]} payload bytes, header says {result[2]}")
    if code == _LENGTH:
        return CorruptValue("length", f"value holds {result[1]} bytes, page has {result[2]}")
    if code == _TRUNC_READ:
        return CorruptValue("truncated", f"read {result[1]} of {result[2]} payload bytes")
    if code == _CHECKSUM:
        return CorruptValue("checksum", f"checksum mismatch for {key!r}")
    raise RuntimeError(f"unknown result code {code}")


def library_path() -> Path:
    """Where the module for this source, compiler, interpreter and machine lives."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return cached_library("fileio", SOURCE, _flags(), sys.version, suffix=suffix)


def _flags() -> list[str]:
    return [*_FLAGS, f"-I{sysconfig.get_paths()['include']}"]


def _build(target: Path) -> None:
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise OSError(f"no Python.h under {include}")
    build_library(SOURCE, target, _flags())


def _crc_address() -> int:
    import isal.isal_zlib

    fn = ctypes.CDLL(isal.isal_zlib.__file__).crc32_gzip_refl
    address = ctypes.cast(fn, ctypes.c_void_p).value
    if not address:
        raise OSError("isal has no crc32_gzip_refl")
    return int(address)


def _load(path: Path) -> NativeFileIO:
    loader = importlib.machinery.ExtensionFileLoader(_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_NAME, str(path), loader=loader)
    if spec is None:
        raise OSError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    abi, fixed, _chunk = module.abi()
    if abi != _ABI or fixed != FIXED_HEADER_SIZE:
        raise OSError(f"{path}: ABI {abi}, header {fixed}; expected {_ABI}, {FIXED_HEADER_SIZE}")
    module.set_crc(_crc_address())
    native = NativeFileIO(module, path)
    _self_test(native)
    return native


def _self_test(native: NativeFileIO) -> None:
    """A value written by the module reads back through io.py, and one written by
    io.py through the module (same bytes, header and checksum); a batch checksums as
    framing.py checksums each value."""
    data = bytes(range(256)) * 70
    values: list[list[memoryview | bytes]] = [
        [],
        [data],
        [data[:1], b"", memoryview(data)[1:4097], data[4097:]],
        [data[:13]],
    ]
    expected = [checksum(value) for value in values]
    if (
        native.checksums(values) != expected
        or native.checksums_started(values).result() != expected
    ):
        raise OSError("compiled batch checksum disagrees with framing.py")
    keys = [f"hicache:self-test:{i}" for i in range(len(values))]
    framed = native.frame_values(keys, values)
    if framed != [encode_header(k, v) + b"".join(v) for k, v in zip(keys, values)]:
        raise OSError("compiled framing disagrees with framing.py")
    pages = [[memoryview(bytearray(len(b"".join(v))))] for v in values]
    unframed = native.unframe_values(keys, framed, pages)
    if unframed != [len(b"".join(v)) for v in values] or [bytes(p[0]) for p in pages] != [
        b"".join(v) for v in values
    ]:
        raise OSError("compiled unframing disagrees with framing.py")
    with tempfile.TemporaryDirectory(prefix="hicache-fileio-") as d:
        key = "hicache:self-test:" + "0" * 64
        times = (1_000_000_000, 2_000_000_000)
        a, b = os.path.join(d, "a"), os.path.join(d, "b")
        (native_result,) = native.write_values(
            [(key, a, a + ".tmp", [memoryview(data)], False, times)]
        )
        python_result = write_value((key, b, b + ".tmp", [memoryview(data)], False, times))
        with open(a, "rb") as fa, open(b, "rb") as fb:
            same = fa.read() == fb.read()
        out = bytearray(len(data))
        back = read_value((key, a, [memoryview(out)], 0.0, 3_000_000_000))
        out2 = bytearray(len(data))
        (back2,) = native.read_values([(key, b, [memoryview(out2)], 0.0, 3_000_000_000)])
        if not (
            same
            and native_result == python_result
            and isinstance(back, Read)
            and back == back2
            and out == data
            and out2 == data
        ):
            raise OSError("compiled file I/O disagrees with io.py")


_lock = threading.Lock()  # worker threads ask at once on the first batches: one build


def _native() -> tuple[NativeFileIO | None, str | None]:
    with _lock:
        return _native_once()


@functools.cache
def _native_once() -> tuple[NativeFileIO | None, str | None]:
    if disabled():
        return None, "disabled by HICACHE_NATIVE"
    if not sys.platform.startswith("linux"):
        return None, f"not built on {sys.platform}"
    try:
        path = library_path()
        if not path.exists():
            _build(path)
        return _load(path), None
    except (OSError, ImportError, subprocess.SubprocessError, ValueError, AttributeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def native_file_io() -> NativeFileIO | None:
    """The compiled loops, built on the first call of the process; None where they cannot be
    (see `unavailable_reason`)."""
    return _native()[0]


def unavailable_reason() -> str | None:
    """Why `native_file_io()` is None, else None."""
    return _native()[1]


__all__ = ["NativeFileIO", "StartedChecksums", "expire_le", "native_file_io", "unavailable_reason"]
