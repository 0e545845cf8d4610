"""Recurrent-state snapshots kept as pages of the cache's own pool.

A snapshot of the state after token g - 1 is stored as a short chain of pages below the node
that ends at g, keyed by the prefix followed by `STATE_TOKEN` (an id no tokenizer hands out).
So the snapshot belongs to exactly that prefix, in every tier: L1 and L2 hold it in the same
pools as K/V, write-through backs it up, eviction and load-back move it, and its L3 key is the
prefix's chain hash extended by the sentinel page (per salt, model, shard and dtype, like any
page). A snapshot's pages are written once and read only by a match that found all of them;
a missing or partial chain is simply no snapshot there.

Each snapshot starts with a small header (magic, format, the byte count the model declared)
so a chain written for another geometry reads as absent, never as a state.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from hicache.kernels.pools import DevicePool

__all__ = [
    "STATE_TOKEN",
    "TOKEN_LIMIT",
    "page_bytes",
    "read_state",
    "state_key",
    "state_pages",
    "write_state",
]

TOKEN_LIMIT = 2**32 - 256
"""Token ids at or above this are the cache's own; a hybrid request's tokens stay below."""
STATE_TOKEN = 2**32 - 1

_HEADER = struct.Struct("<4sIQ")  # magic, format, state bytes
_MAGIC = b"HCST"
_FORMAT = 1


def page_bytes(pool: DevicePool) -> int:
    """Bytes one page holds across every layer and component of the pool."""
    g = pool.geometry
    return pool.page_size * g.layers * g.components * g.row_heads * g.row_dim * g.itemsize


def state_pages(pool: DevicePool, state_bytes: int) -> int:
    """Pages one snapshot of `state_bytes` (plus its header) takes."""
    return math.ceil((state_bytes + _HEADER.size) / page_bytes(pool))


def state_key(prefix: np.ndarray, pages: int, page_size: int) -> np.ndarray:
    """The tokens a snapshot after `prefix` is kept under."""
    tail = np.full(pages * page_size, STATE_TOKEN, dtype=np.int64)
    return np.concatenate([np.asarray(prefix, dtype=np.int64), tail])


def _rows(pool: DevicePool) -> list[torch.Tensor]:
    """Every buffer of the pool as (size, row bytes) uint8 views, in layer, component order."""
    out = []
    for layer in range(pool.geometry.layers):
        for component in range(pool.geometry.components):
            buf = pool.buffer(layer, component)
            out.append(buf.view(torch.uint8).reshape(pool.size, -1))
    return out


def _cpu_rows(pool: DevicePool) -> list[np.ndarray]:
    """The same views as numpy arrays (a CPU pool): numpy's gathers and scatters of a few
    rows cost microseconds, torch's index ops a thread pool's hand-off each."""
    return [r.numpy() for r in _rows(pool)]


def write_state(pool: DevicePool, slots: np.ndarray, state: bytes | bytearray | memoryview) -> None:
    """Write one snapshot into device `slots` (whole pages of them)."""
    data = bytes(_HEADER.pack(_MAGIC, _FORMAT, len(state))) + bytes(state)
    rows = _rows(pool)
    capacity = len(slots) * sum(r.shape[1] for r in rows)
    if len(data) > capacity:
        raise ValueError(f"a snapshot of {len(data)} bytes does not fit {len(slots)} slots")
    padded = np.zeros(capacity, dtype=np.uint8)
    padded[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    index = np.array(slots, dtype=np.int64)
    at = 0
    if pool.device.type == "cpu":
        for arr in _cpu_rows(pool):
            n = len(slots) * arr.shape[1]
            arr[index] = padded[at : at + n].reshape(len(slots), arr.shape[1])
            at += n
        return
    where = torch.as_tensor(index, device=pool.device)
    for r in rows:
        n = len(slots) * r.shape[1]
        chunk = torch.from_numpy(padded[at : at + n]).view(len(slots), r.shape[1])
        r[where] = chunk.to(pool.device)
        at += n


def read_state(pool: DevicePool, slots: np.ndarray, state_bytes: int) -> bytes | None:
    """The snapshot in device `slots`, or None when they do not hold one of `state_bytes`
    written in this format."""
    index = np.array(slots, dtype=np.int64)
    if pool.device.type == "cpu":
        data = b"".join(arr[index].tobytes() for arr in _cpu_rows(pool))
    else:
        where = torch.as_tensor(index, device=pool.device)
        data = torch.cat([r[where].reshape(-1).cpu() for r in _rows(pool)]).numpy().tobytes()
    if len(data) < _HEADER.size + state_bytes:
        return None
    magic, fmt, size = _HEADER.unpack_from(data)
    if magic != _MAGIC or fmt != _FORMAT or size != state_bytes:
        return None
    return data[_HEADER.size : _HEADER.size + state_bytes]
