"""Chained page hashes in one compiled call (pagehash.c), for `hicache.radix.hashes`.

Why: the chain costs one SHA-256 of some hundred bytes per page, and hashing page by page
from Python spent most of its time on the calls around each digest (about 1.1 us a page
against 0.26 here, docs/benchmarks.md "One page's way to the store and back"). The digest is
the process's libcrypto (the library `hashlib` itself loaded), so the hashes are the same
bytes; `install()` hands the loop to the radix core, which keeps its Python loop wherever
this cannot be built or libcrypto lacks the calls.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib  # loads the libcrypto the chain calls into
import subprocess
from pathlib import Path
from typing import Any

from hicache.kernels.native.build import disabled, load_library
from hicache.radix import hashes

SOURCE = Path(__file__).with_name("pagehash.c")
ABI = 1
_FLAGS = ["-O2", "-shared", "-fPIC"]


class PageHasher:
    """The loaded loop and libcrypto's SHA-256 calls it is given."""

    def __init__(self, chain: Any, sha256: tuple[int, int, int]) -> None:
        self._chain = chain
        self._sha256 = sha256

    def __call__(self, prior: bytes, raw: bytes, stride: int, pages: int) -> bytes:
        """The 32-byte digests of `pages` pages of `stride` bytes of `raw`, chained from
        `prior` (b"" or 32 bytes), end to end."""
        out = ctypes.create_string_buffer(32 * pages)
        failed = self._chain(*self._sha256, prior or None, len(prior), raw, stride, pages, out)
        if failed:  # libcrypto refused a call: the radix core hashes this run itself
            raise OSError(f"libcrypto's SHA-256 failed at page {failed - 1}")
        return out.raw


def _libcrypto() -> ctypes.CDLL:
    """The libcrypto `hashlib` loaded (found in the process's maps), else the system's."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libcrypto" in path:
                    return ctypes.CDLL(path)
    except OSError:
        pass
    name = ctypes.util.find_library("crypto")
    if name is None:
        raise OSError("libcrypto not found")
    return ctypes.CDLL(name)


@functools.cache
def page_hasher() -> PageHasher | None:
    """The compiled chain, built on first use; None where it cannot be (no compiler, no
    libcrypto with SHA256_Init/Update/Final, `HICACHE_NATIVE=0`)."""
    if disabled():
        return None
    try:
        crypto = _libcrypto()
        sha256 = tuple(
            ctypes.cast(getattr(crypto, name), ctypes.c_void_p).value or 0
            for name in ("SHA256_Init", "SHA256_Update", "SHA256_Final")
        )
        chain = load_library("pagehash", SOURCE, _FLAGS, ABI).hicache_chain_sha256
        chain.restype = ctypes.c_int64
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        chain.argtypes = [ptr, ptr, ptr, ctypes.c_char_p, i64, ctypes.c_char_p, i64, i64, ptr]
    except (OSError, AttributeError, subprocess.SubprocessError, ValueError, ImportError):
        return None
    if not all(sha256):
        return None
    hasher = PageHasher(chain, (sha256[0], sha256[1], sha256[2]))
    # Checked once against hashlib: the same bytes, or not used at all.
    probe = bytes(range(256)) * 2
    first = hashlib.sha256(probe[:256]).digest()
    if hasher(b"", probe, 256, 2) != first + hashlib.sha256(first + probe[256:]).digest():
        return None
    return hasher


def install() -> bool:
    """Hand the compiled chain to `hicache.radix.hashes` (once per process; idempotent).
    True if it is in use."""
    hasher = page_hasher()
    if hasher is not None:
        hashes.use_digest_loop(hasher)
    return hasher is not None
