"""Checks and helpers shared by backends for one batch call: argument validation (raised
before anything changes), the consecutive-prefix count, and the counters every backend keeps."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from hicache.backends.base import PageBuffer
from hicache.backends.keys import Namespace


def check_keys(namespace: Namespace, keys: Sequence[str]) -> None:
    """Every key must be a string of `namespace`: a foreign key is a caller's bug."""
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys must be a sequence of key strings, not a single string")
    prefix = namespace.prefix
    for k in keys:
        if not isinstance(k, str) or not k.startswith(prefix):
            raise ValueError(f"key {k!r} is not in this backend's namespace {prefix!r}")


def check_buffers(
    namespace: Namespace, keys: Sequence[str], buffers: Sequence[PageBuffer], *, writable: bool
) -> list[list[memoryview]]:
    """Validate a batch and return each page's pieces as flat byte views (no copies)."""
    check_keys(namespace, keys)
    if len(buffers) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(buffers)} page buffers")
    pages: list[list[memoryview]] = []
    for i, pieces in enumerate(buffers):
        if getattr(pieces, "checked", False):  # a host pool's page: checked when made
            pages.append(pieces)  # type: ignore[arg-type]  # a PagePieces is a list
            continue
        if isinstance(pieces, (bytes, bytearray, memoryview)):
            raise TypeError(f"page {i}: a page buffer is a sequence of pieces, got one buffer")
        views = []
        for j, piece in enumerate(pieces):
            try:
                view = memoryview(piece)
            except TypeError:
                raise TypeError(
                    f"page {i} piece {j}: {type(piece).__name__} is not a buffer"
                ) from None
            if not view.c_contiguous:
                raise ValueError(f"page {i} piece {j} is not C-contiguous")
            if writable and view.readonly:
                raise ValueError(f"page {i} piece {j} is read-only; get_into needs writable pieces")
            views.append(view.cast("B") if view.ndim != 1 or view.format != "B" else view)
        pages.append(views)
    return pages


def prefix_count(oks: Iterable[bool]) -> int:
    """How many leading items are true."""
    n = 0
    for ok in oks:
        if not ok:
            break
        n += 1
    return n


@dataclass(slots=True)
class Counters:
    """A backend's running totals. Owned and mutated by its backend on the event loop's
    thread only (worker threads return results; they never touch counters)."""

    gets: int = 0  # pages asked for by get_into
    get_hits: int = 0  # pages read and verified
    sets: int = 0  # pages asked to store
    set_ok: int = 0  # pages stored
    exists_calls: int = 0
    deletes: int = 0
    bytes_read: int = 0  # payload bytes delivered into pages
    bytes_written: int = 0  # payload bytes stored
    corrupt: int = 0  # values that failed verification (then deleted)
    errors: int = 0  # I/O errors (a miss or a failed store)
    evictions: int = 0  # values removed by a size cap

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
