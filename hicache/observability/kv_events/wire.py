"""The wire format: vLLM's KV event structs (`vllm/distributed/kv_events.py`) and block hashes."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

GPU, CPU, STORAGE = "GPU", "CPU", "STORAGE"
MEDIUMS = (GPU, CPU, STORAGE)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
MAX_HASHES_PER_EVENT = 4096  # a removal of more pages is split over several events

ExternalBlockHash = bytes | int  # vLLM's ExternalBlockHash


# Written from vLLM's schema (vllm/distributed/kv_events.py). Fields that vLLM declares without
# a default are always on the wire (as nil when None): its decoders require them.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A KV cache event: a msgpack map whose `"type"` key names the class."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The positional form of vLLM before #42892: `[tag, field, field, ...]`."""


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


# (BlockStored, BlockRemoved, AllBlocksCleared) classes per `encoding`.
EVENT_CLASSES: dict[str, tuple[type[Any], type[Any], type[Any]]] = {
    "map": (BlockStored, BlockRemoved, AllBlocksCleared),
    "array": (ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared),
}


def external_block_hash(page_hash: str, form: Literal["int", "bytes"] = "int") -> ExternalBlockHash:
    """A hicache page hash (64 hex digits) as vLLM sends a block hash: by default (vLLM's
    `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`) `int.from_bytes(digest, "big") & (2**64 - 1)`, i.e.
    the last 8 bytes as an unsigned int; `form="bytes"`: the 32-byte digest."""
    if form == "int":
        return int(page_hash[-16:], 16)
    return bytes.fromhex(page_hash)
