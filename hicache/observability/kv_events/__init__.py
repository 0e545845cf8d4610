"""KV cache events in vLLM's wire format, over ZeroMQ (optional extra: `hicache[kv-events]`).

A router built for vLLM's KV events (`vllm/distributed/kv_events.py`) consumes these unchanged:

- one ZMQ PUB multipart message per batch: `(topic, sequence as 8 bytes big-endian, payload)`,
  sequences 0, 1, 2, ... per publisher;
- the payload is msgpack of `EventBatch(ts, events, data_parallel_rank)`, a positional array;
  each event is a msgpack map tagged under `"type"` (`BlockStored`, `BlockRemoved`,
  `AllBlocksCleared`), as vLLM encodes them since vllm-project/vllm#42892; `encoding="array"`
  gives the positional events of earlier vLLM instead;
- a ROUTER socket (optional) answers a request carrying an 8-byte big-endian start sequence
  with one `(sequence, payload)` message per buffered batch from there on, then the end marker
  `(-1 as 8 signed bytes, b"")`;
- `medium` is `"GPU"` (L1), `"CPU"` (L2) or `"STORAGE"` (L3); block hashes are hicache's
  chained SHA-256 page hashes (`hicache.radix.hashes`), sent as vLLM sends its own by
  default: the digest's last 8 bytes as an unsigned big-endian int (`block_hash="bytes"`: the
  whole 32-byte digest).

`TreeKVEvents` (`tree.py`) turns a `RadixTree`'s tier changes (it is the tree's
`TreeObserver`) and three events of the cache's log (`uploader.stored`,
`tree.storage_cleared`, `storage.detached`) into these events; `KVEventPublisher`
(`publisher.py`, its sockets in `transport.py`) batches and sends them from a thread of its
own; `start_kv_events` wires both from a `CacheConfig`. The structs are in `wire.py`.
docs/kv-events.md has what a router sees and what it cannot.
"""

# Checked here, before any submodule imports them, to name the extra that is missing.
try:
    import msgspec  # noqa: F401
    import zmq  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"hicache KV events need pyzmq and msgspec: pip install 'hicache[kv-events]' ({exc})"
    ) from None

from hicache.observability.kv_events.publisher import KVEventPublisher
from hicache.observability.kv_events.tree import TreeKVEvents, start_kv_events
from hicache.observability.kv_events.wire import CPU as CPU
from hicache.observability.kv_events.wire import END_SEQ as END_SEQ
from hicache.observability.kv_events.wire import GPU as GPU
from hicache.observability.kv_events.wire import MEDIUMS as MEDIUMS
from hicache.observability.kv_events.wire import STORAGE as STORAGE
from hicache.observability.kv_events.wire import (
    AllBlocksCleared,
    ArrayAllBlocksCleared,
    ArrayBlockRemoved,
    ArrayBlockStored,
    ArrayKVEventBatch,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventBatch,
    external_block_hash,
)
from hicache.observability.kv_events.wire import ArrayKVCacheEvent as ArrayKVCacheEvent
from hicache.observability.kv_events.wire import ExternalBlockHash as ExternalBlockHash
from hicache.observability.kv_events.wire import KVCacheEvent as KVCacheEvent

# The `X as X` imports above: public names kept out of `__all__`, importable from here as they
# were before the module became a package.
__all__ = [
    "AllBlocksCleared",
    "ArrayAllBlocksCleared",
    "ArrayBlockRemoved",
    "ArrayBlockStored",
    "ArrayKVEventBatch",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEventBatch",
    "KVEventPublisher",
    "TreeKVEvents",
    "external_block_hash",
    "start_kv_events",
]
