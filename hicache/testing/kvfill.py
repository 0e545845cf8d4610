"""Synthetic KV bytes, the stand-in model of the replay and the test kit: a pure function of
(page seed, layer, position in page), so every page that reaches L1 from any tier can be
checked against what it must be.

Bytes, not values, are generated (so every dtype, 8-bit floats included, works the same): token
t of a page with seed s holds, in layer l and component c (K, V or the MLA latent), the bytes
`(s + 131*l + 61*c + 7*t + j) mod 256` for j over the token's row.

A row is therefore one of 256 windows of the ramp 0, 1, ..., 255, 0, 1, ...: the expected rows
are gathered from a (256, width) table of those windows, and on CPU pools written and compared
through numpy views of the pool, with no per-element arithmetic. A whole page is likewise one
of 256 blocks (its first row's window decides the rest): where a request's whole pages sit in
whole, aligned pages of a CPU pool (a paged allocator's slots), they are copied a block at a
time from a (256, page bytes) table (one call of the compiled row copier where it is built),
and checked in runs of pages small enough to stay in the CPU cache, compared as 8-byte
words; other slots go row by row.

Pools off the host (a GPU) are written and checked where they live, with torch ops on the
pool's device (`_fill_on_device`, `_bad_on_device`): the windows table sits there once, a
(layer, component) costs a gather and a scatter (fill) or two gathers and a comparison
(check), and only the token positions go over and one bad-token mask comes back.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from hicache.kernels.native.rowcopy import native_rows
from hicache.kernels.pools import DevicePool

_PAGE_TABLE_MAX = 4 << 20
"""Largest (256, page bytes) table kept per (row width, page size); wider pages go by rows."""

_RUN_BYTES = 256 << 10
"""Bytes of one (layer, component) worked on at once on the page path: its temporaries stay in
the CPU cache."""

_STREAM_BYTES = 8 << 20
"""Page writes larger than this stream past the cache (non-temporal stores)."""


def page_seeds(hashes: Sequence[str]) -> np.ndarray:
    """One small integer per page, from its chained hash."""
    return np.fromiter((int(h[:8], 16) & 0xFFFF for h in hashes), dtype=np.int64, count=len(hashes))


def _rest_bases(
    seeds: np.ndarray, page_size: int, first: int, count: int, rest: np.ndarray
) -> np.ndarray:
    """The base (first row's window) of tokens first + rest[i] of tokens first .. first+count:
    their page's seed + 7 x their place in the page. IndexError when `seeds` has no seed for
    the last token's page."""
    if count and len(seeds) <= (first + count - 1) // page_size:
        raise IndexError(f"{len(seeds)} page seeds for tokens up to {first + count - 1}")
    positions = first + rest.astype(np.int64)
    return seeds[positions // page_size] + 7 * (positions % page_size)


@lru_cache(maxsize=16)
def _windows(width: int) -> np.ndarray:
    """Row r is (r + j) mod 256 for j < width: every row the pattern can produce."""
    ramp = (np.arange(width + 256, dtype=np.int64) % 256).astype(np.uint8)
    table = np.lib.stride_tricks.sliding_window_view(ramp, width)[:256]
    return np.ascontiguousarray(table)


@lru_cache(maxsize=16)
def _page_table(width: int, page_size: int) -> np.ndarray | None:
    """Row b is a whole page whose first token's row is window b: token t holds window
    (b + 7t) mod 256. None when larger than `_PAGE_TABLE_MAX` or not whole 8-byte words."""
    if 256 * page_size * width > _PAGE_TABLE_MAX or (page_size * width) % 8:
        return None
    first = np.arange(256, dtype=np.int64)[:, None] + 7 * np.arange(page_size, dtype=np.int64)
    table = _windows(width)[first % 256].reshape(256, page_size * width)
    return np.ascontiguousarray(table)


def _rows(pool: DevicePool, layer: int, component: int) -> torch.Tensor:
    buf = pool.buffer(layer, component)
    return buf.view(torch.uint8).reshape(buf.shape[0], -1)


def _expected(bases: np.ndarray, layer: int, component: int, width: int) -> np.ndarray:
    shift = 131 * layer + 61 * component
    rows: np.ndarray = _windows(width)[(bases + shift) % 256]
    return rows


class _Split:
    """The tokens first .. first+len(slots) of a request split for the page path: `body`,
    the whole pages `pages` (pool page numbers) whose slots are whole aligned pool pages,
    with their seeds `page_seeds`; the tokens outside it (`rest`: indices into slots) go by
    rows. `pages` is None when the page path does not apply (then every token is in rest)."""

    __slots__ = ("pages", "page_seeds", "body", "rest", "table")

    def __init__(
        self, pool: DevicePool, slots: np.ndarray, seeds: np.ndarray, page_size: int, first: int
    ) -> None:
        n = len(slots)
        self.pages: np.ndarray | None = None
        self.page_seeds = np.empty(0, dtype=np.int64)
        self.body = slice(0, 0)
        self.rest = np.arange(n)
        rows = _rows(pool, 0, 0)
        if rows.device.type != "cpu" or rows.shape[0] % page_size:
            self.table = None
            return
        self.table = _page_table(rows.shape[1], page_size)
        head = min(n, -first % page_size)
        whole = (n - head) // page_size
        if self.table is None or whole == 0:
            return
        body = slots[head : head + whole * page_size].reshape(whole, page_size)
        starts = body[:, 0]
        if (
            starts.min() < 0
            or starts.max() + page_size > rows.shape[0]
            or (starts % page_size).any()
            or (body != starts[:, None] + np.arange(page_size)).any()
        ):
            return
        first_page = (first + head) // page_size
        self.pages = starts // page_size
        self.page_seeds = np.asarray(seeds[first_page : first_page + whole], dtype=np.int64)
        self.body = slice(head, head + whole * page_size)
        self.rest = np.r_[0:head, head + whole * page_size : n]


def _page_runs(count: int, page_bytes: int) -> list[tuple[int, int]]:
    step = max(1, _RUN_BYTES // page_bytes)
    return [(lo, min(count, lo + step)) for lo in range(0, count, step)]


@lru_cache(maxsize=16)
def _doubled_windows(width: int, device: torch.device) -> torch.Tensor:
    """Rows 0..511 of the windows on `device`: rows s .. s+255 are the table shifted by `s`
    (row i is window (i + s) mod 256), so a shifted lookup is a slice and one gather."""
    table = torch.from_numpy(_windows(width))
    return torch.cat([table, table]).to(device)


class _OnDevice:
    """One request's tokens as the device path needs them: their slots and their windows'
    bases (before the (layer, component) shift) as int64 tensors on the pool's device."""

    __slots__ = ("slots", "bases", "table")

    def __init__(
        self, pool: DevicePool, index: np.ndarray, seeds: np.ndarray, page_size: int, first: int
    ) -> None:
        bases = _rest_bases(seeds, page_size, first, len(index), np.arange(len(index))) % 256
        device = pool.device
        self.slots = torch.tensor(index, device=device)  # a copy: slot arrays may be read-only
        self.bases = torch.tensor(bases, device=device)
        self.table = _doubled_windows(_rows(pool, 0, 0).shape[1], device)

    def expected(self, layer: int, component: int) -> torch.Tensor:
        shift = (131 * layer + 61 * component) % 256
        return self.table[shift : shift + 256].index_select(0, self.bases)


def _fill_on_device(
    pool: DevicePool, index: np.ndarray, seeds: np.ndarray, page_size: int, first: int
) -> None:
    at = _OnDevice(pool, index, seeds, page_size, first)
    for layer in range(pool.geometry.layers):
        for comp in range(pool.geometry.components):
            _rows(pool, layer, comp).index_copy_(0, at.slots, at.expected(layer, comp))


def _bad_on_device(
    pool: DevicePool, index: np.ndarray, seeds: np.ndarray, page_size: int, first: int
) -> int:
    at = _OnDevice(pool, index, seeds, page_size, first)
    bad = torch.zeros(len(index), dtype=torch.bool, device=pool.device)
    for layer in range(pool.geometry.layers):
        for comp in range(pool.geometry.components):
            got = _rows(pool, layer, comp).index_select(0, at.slots)
            bad |= (got != at.expected(layer, comp)).any(dim=1)
    positions = np.arange(first, first + len(index))
    return len(np.unique(positions[bad.cpu().numpy()] // page_size))


def fill(
    pool: DevicePool, slots: np.ndarray, seeds: np.ndarray, *, page_size: int, first: int
) -> None:
    """Write the KV of tokens first .. first+len(slots) of a request into `slots` (nothing
    in a pool of 0 layers: its pages hold no bytes)."""
    if not len(slots) or not pool.geometry.layers:
        return
    index = np.asarray(slots, dtype=np.int64)
    if pool.device.type != "cpu":
        _fill_on_device(pool, index, seeds, page_size, first)
        return
    split = _Split(pool, index, seeds, page_size, first)
    rest = split.rest
    bases = _rest_bases(seeds, page_size, first, len(index), rest)
    at = index[rest]
    for layer in range(pool.geometry.layers):
        for comp in range(pool.geometry.components):
            rows = _rows(pool, layer, comp)
            if split.pages is not None and split.table is not None:
                shift = 131 * layer + 61 * comp
                pages = rows.numpy().reshape(-1, split.table.shape[1])
                blocks = (split.page_seeds + shift) % 256
                _copy_pages(pages, split.pages, split.table, blocks)
            if not len(at):
                continue
            # each token's row is one window of the table: copied from there in one pass
            shift = 131 * layer + 61 * comp
            _copy_pages(rows.numpy(), at, _windows(rows.shape[1]), (bases + shift) % 256)


def count_bad_pages(
    pool: DevicePool, slots: np.ndarray, seeds: np.ndarray, *, page_size: int, first: int
) -> int:
    """How many pages among tokens first .. first+len(slots) do not hold what they must
    (none in a pool of 0 layers: there is nothing they must hold)."""
    if not len(slots) or not pool.geometry.layers:
        return 0
    index = np.asarray(slots, dtype=np.int64)
    if pool.device.type != "cpu":
        return _bad_on_device(pool, index, seeds, page_size, first)
    split = _Split(pool, index, seeds, page_size, first)
    rest = split.rest
    bases = _rest_bases(seeds, page_size, first, len(index), rest)
    at = index[rest]
    bad_tokens = np.zeros(len(rest), dtype=bool)
    bad_body = np.zeros(len(split.page_seeds), dtype=bool)
    for layer in range(pool.geometry.layers):
        for comp in range(pool.geometry.components):
            rows = _rows(pool, layer, comp)
            if split.pages is not None and split.table is not None:
                _check_pages(rows.numpy(), split, 131 * layer + 61 * comp, bad_body)
            if not len(at):
                continue
            got = rows.numpy()[at]
            bad_tokens |= (got != _expected(bases, layer, comp, rows.shape[1])).any(axis=1)
    positions = np.arange(first, first + len(index))
    bad = np.concatenate(
        [
            positions[rest][bad_tokens] // page_size,
            positions[split.body][::page_size][bad_body] // page_size,
        ]
    )
    return len(np.unique(bad))


def _check_pages(rows: np.ndarray, split: _Split, shift: int, bad: np.ndarray) -> None:
    """Mark in `bad` the body pages whose bytes in `rows` (one layer and component) differ
    from their block, compared as 8-byte words a run of pages at a time."""
    assert split.pages is not None and split.table is not None
    table = split.table
    pages = rows.reshape(-1, table.shape[1])
    blocks = (split.page_seeds + shift) % 256
    runs = _page_runs(len(blocks), table.shape[1])
    step = runs[0][1] - runs[0][0]
    got = np.empty((step, table.shape[1]), dtype=np.uint8)
    want = np.empty_like(got)
    got64, want64 = got.view(np.uint64), want.view(np.uint64)
    differ = np.empty(got64.shape, dtype=bool)
    for lo, hi in runs:
        k = hi - lo
        np.take(pages, split.pages[lo:hi], axis=0, out=got[:k], mode="clip")
        np.take(table, blocks[lo:hi], axis=0, out=want[:k], mode="clip")
        np.not_equal(got64[:k], want64[:k], out=differ[:k])
        if differ[:k].any():
            bad[lo:hi] |= differ[:k].any(axis=1)


def _copy_pages(
    dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray
) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for every i: whole (rows, bytes) uint8 rows (pages,
    or single token rows), in range (checked by the caller). One call of the compiled row copier
    (kernels/native/rowcopy.py) where it is built, streaming past the cache when large; numpy a run
    at a time otherwise."""
    native = native_rows()
    n = len(src_rows)
    if native is not None:
        streaming = n * dst.shape[1] > _STREAM_BYTES
        native.copy(dst, src, dst_rows, 0, src_rows, 0, n, streaming=streaming)
        return
    for lo, hi in _page_runs(n, dst.shape[1]):
        dst[dst_rows[lo:hi]] = src[src_rows[lo:hi]]
