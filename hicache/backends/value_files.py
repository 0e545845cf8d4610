"""Value files at the file store's paths, as the backends that move their bytes some other
way (nixl.py, hf3fs.py) create, place, check and remove them. The format is the file store's:
a framed value (framing.py) per file, written under a temporary name and renamed into place."""

from __future__ import annotations

import contextlib
import os

from hicache.backends.batch import prefix_count
from hicache.backends.framing import FIXED_HEADER_SIZE, CorruptValue, decode_header


def create_temp(tmp: str) -> int:
    """A new temporary file (its directory made if missing), open for writing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(tmp, flags, 0o600)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(tmp), mode=0o700, exist_ok=True)
        return os.open(tmp, flags, 0o600)


def place(tmp: str, path: str) -> None:
    """Rename a written temporary file into place (its shard directory made if missing)."""
    try:
        os.replace(tmp, path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.replace(tmp, path)


def size_mismatch(fd: int, key: str, size: int, want: int) -> str:
    """Why a value file of `size` bytes cannot be a `want`-byte page: its header's reason."""
    head = os.pread(fd, FIXED_HEADER_SIZE + 4096, 0)
    try:
        header = decode_header(head, key)
    except CorruptValue as exc:
        return exc.reason
    return "length" if header.payload_len != want else "truncated"


def count_present(paths: list[str]) -> int:
    """How many leading paths exist (the consecutive prefix `exists` reports)."""
    return prefix_count(os.path.exists(p) for p in paths)


def unlink_all(paths: list[str]) -> None:
    """Remove the files that exist among `paths`."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
