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

Snapshots may instead live in a cache of their own (`state_config`: its pools sized in
snapshots, its L3 values under a model id of their own, `state_model_id`): there a snapshot is keyed by a
digest of its prefix (`prefix_digests`, 248 bits in the first page's tokens) and fills whole
pages from the first, so it takes no room in the K/V pools.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable
from dataclasses import replace

import numpy as np
import torch

from hicache.config import CacheConfig, ConfigError
from hicache.hybrid.groups import HybridModel
from hicache.kernels.pools import DevicePool

__all__ = [
    "DIGEST_TOKENS",
    "STATE_GROUP",
    "STATE_TOKEN",
    "TOKEN_LIMIT",
    "page_bytes",
    "prefix_digests",
    "read_state",
    "state_config",
    "state_key",
    "state_model_id",
    "state_pages",
    "write_state",
]

TOKEN_LIMIT = 2**32 - 256
"""Token ids at or above this are the cache's own; a hybrid request's tokens stay below."""
STATE_TOKEN = 2**32 - 1

DIGEST_TOKENS = 8
"""Tokens of a prefix digest: a states cache's page size (`state_config`)."""
STATE_GROUP = "#state"
"""Appended to the model id of a states cache: its L3 values are a group of their own."""

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


def prefix_digests(tokens: np.ndarray, points: Iterable[int]) -> dict[int, np.ndarray]:
    """For each point p, `DIGEST_TOKENS` token ids naming tokens[:p] (BLAKE2b of the ids,
    31 bits a token: 248 bits, so two prefixes never share a snapshot). One pass over the
    tokens for all points; ids must be below 2**32 (HybridCache checks them)."""
    h = hashlib.blake2b(digest_size=4 * DIGEST_TOKENS, person=b"hicache-state")
    ids = np.ascontiguousarray(tokens, dtype="<u4")
    out: dict[int, np.ndarray] = {}
    at = 0
    for p in sorted(set(points)):
        h.update(ids[at:p].tobytes())
        at = p
        words = np.frombuffer(h.copy().digest(), dtype="<u4") & np.uint32(0x7FFF_FFFF)
        out[p] = words.astype(np.int64)
    return out


def state_model_id(base: CacheConfig) -> str:
    """A states cache's model id: the K/V cache's, `STATE_GROUP`, and its K/V spec (a state
    kept for one dtype or geometry is never read by another)."""
    return f"{base.model_id}{STATE_GROUP}:{base.kv}"


def state_config(
    base: CacheConfig,
    model: HybridModel,
    *,
    device_snapshots: int | None = None,
    host_snapshots: int | None = None,
) -> CacheConfig:
    """The config of a cache that holds `model`'s snapshots apart from the K/V (pass it
    opened as `HybridCache(..., states=)`): one snapshot a page of `DIGEST_TOKENS` slots,
    `device_snapshots` in L1 and `host_snapshots` in L2 (defaults: one per grid point of
    `base`'s L1, at least 16; one per grid point of its L2, at least twice L1's). The rest is
    `base`'s (storage, TP rank, policies) but the model id (`state_model_id`: L3 values
    of their own), write-through (a state is demoted before it leaves L1) and no thresholds
    (a snapshot is one page, worth it whole).
    Raises ConfigError naming what is wrong."""
    base.resolve()
    grid = model.grid
    if grid is None:
        raise ConfigError(
            "state_config: the model keeps no snapshots (no recurrent or windowed sliding group)"
        )
    device, host = device_snapshots, host_snapshots
    if device is None:
        device = max(16, base.device_tokens // grid)
    if host is None:
        host = max(2 * device, base.host_capacity // grid)
    for name, value in (("device_snapshots", device), ("host_snapshots", host)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"state_config: {name}={value!r} must be a positive int")
    if host <= device:  # L2 holds what L1 holds and more, as for K/V
        raise ConfigError(
            f"state_config: host_snapshots={host} must be larger than device_snapshots={device}"
        )
    # One head of float32 K and V rows (the pool copies bytes, never reads them as numbers):
    # MHA, because its L3 keys carry the TP rank, and each rank keeps its own shard of a state.
    dim = max(1, math.ceil((model.state_bytes + _HEADER.size) / (DIGEST_TOKENS * 2 * 4)))
    write = "write_through" if base.write_policy == "write_through_selective" else base.write_policy
    return replace(
        base,
        kv=f"mha:1:1:{dim}:float32",
        page_size=DIGEST_TOKENS,
        device_tokens=device * DIGEST_TOKENS,
        host_tokens=host * DIGEST_TOKENS,
        model_id=state_model_id(base),
        write_policy=write,
        prefetch_threshold=0,
        load_back_threshold=0,
        max_pinned_device_tokens=None,
        max_pinned_host_tokens=None,
        metrics_port=None,
        kv_events=None,
        kv_events_replay=None,
    )
