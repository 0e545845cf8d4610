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
  chained SHA-256 page hashes (`hicache.backends.keys`), sent as vLLM sends its own by
  default: the digest's last 8 bytes as an unsigned big-endian int (`block_hash="bytes"`: the
  whole 32-byte digest).

`TreeKVEvents` turns a `RadixTree`'s tier changes (it is the tree's `TreeObserver`) and three
events of the cache's log (`uploader.stored`, `tree.storage_cleared`, `storage.detached`) into these events;
`KVEventPublisher` batches and sends them from a thread of its own; `start_kv_events` wires
both from a `CacheConfig`. docs/kv-events.md has what a router sees and what it cannot.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

try:
    import msgspec
    import zmq
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"hicache KV events need pyzmq and msgspec: pip install 'hicache[kv-events]' ({exc})"
    ) from None

from hicache.backends.keys import chain_page_hashes

if TYPE_CHECKING:
    from hicache.components.tree.core import RadixTree
    from hicache.config import CacheConfig
    from hicache.observability.events import EventLog
    from hicache.types import NodeId

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

_logger = logging.getLogger("hicache.kv_events")

GPU, CPU, STORAGE = "GPU", "CPU", "STORAGE"
MEDIUMS = (GPU, CPU, STORAGE)
_TIER_MEDIUM = {"device": GPU, "host": CPU}
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
_MAX_HASHES_PER_EVENT = 4096  # a removal of more pages is split over several events

ExternalBlockHash = bytes | int  # vLLM's ExternalBlockHash


# ------------------------------------------------------------------------------ wire structs
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


_CLASSES: dict[str, tuple[type[Any], type[Any], type[Any]]] = {
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


def _binds(endpoint: str) -> bool:
    """vLLM's rule, so an endpoint string means what it means there: bind a wildcard host or
    port (`*`, `::`) and ipc/inproc endpoints; connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# ------------------------------------------------------------------------------ the publisher


class KVEventPublisher:
    """Batches KV events and sends them on a ZMQ PUB socket from a thread of its own, keeping
    the last `buffer_steps` batches to answer replay requests on a ROUTER socket.

    `stored`, `removed`, `all_cleared` and `defer` may be called from any thread and never
    block or make a system call: they append to a list. Every `batch_interval` seconds the
    thread takes what has queued and sends it as one batch (at most `max_batch_events` events
    a batch), so the thread wakes on a timer, not per event, and what is costly to build is
    built there (`defer`). `flush()` waits until everything queued so far is sent; `close()`
    sends what is queued and stops.

    `endpoint` binds when it has a wildcard (`tcp://*:5557`, `tcp://127.0.0.1:*` for any free
    port) or is ipc/inproc, and connects otherwise (vLLM's rule); `replay_endpoint` always
    binds. `self.endpoint` / `self.replay_endpoint` are the addresses actually bound.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = 0,
        encoding: Literal["map", "array"] = "map",
        max_batch_events: int = 1024,
        batch_interval: float = 0.01,
        linger: float = 1.0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if encoding not in _CLASSES:
            raise ValueError(f"encoding={encoding!r} must be 'map' or 'array'")
        if buffer_steps < 1 or max_batch_events < 1:
            raise ValueError("buffer_steps and max_batch_events must be >= 1")
        if not batch_interval > 0:
            raise ValueError(f"batch_interval={batch_interval!r} must be > 0 seconds")
        self._interval_ms = max(1, round(batch_interval * 1000))
        self._stored_cls, self._removed_cls, self._cleared_cls = _CLASSES[encoding]
        self.encoding = encoding
        self._topic = topic.encode("utf-8")
        self._dp_rank = data_parallel_rank
        self._max_batch = max_batch_events
        ctx = context if context is not None else zmq.Context.instance()
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub = ctx.socket(zmq.PUB)
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, int(linger * 1000))
            if _binds(endpoint):
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * buffer_steps + 16)  # a whole replay fits
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self._close_sockets(linger=0)
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)  # the thread's
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._cond = threading.Condition()
        self._pending: list[Any] = []  # events, and thunks making lists of events (defer)
        self._closing = False
        self._dead = False
        self._queued = 0  # items (events, deferred makers) accepted so far
        self._sent = 0  # items published so far
        self._next_seq = 0
        self.published_batches = 0
        self.dropped_events = 0  # queued after close
        self.errors = 0  # failed sends, bad replay requests
        self.wakeups = 0  # the thread's loop turns: about one per batch_interval when idle
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- producers (any thread)
    def stored(
        self,
        block_hashes: list[ExternalBlockHash],
        parent: ExternalBlockHash | None,
        token_ids: list[int],
        block_size: int,
        medium: str,
    ) -> None:
        self._put(self.stored_event(block_hashes, parent, token_ids, block_size, medium))

    def removed(self, block_hashes: list[ExternalBlockHash], medium: str) -> None:
        for event in self.removed_events(block_hashes, medium):
            self._put(event)

    def all_cleared(self) -> None:
        self._put(self._cleared_cls())

    def defer(self, make: Callable[[], list[Any]]) -> None:
        """Queue `make`, called on the publisher's thread when the batch is cut, for the events
        it returns (made with `stored_event` / `removed_events`), in place: what is costly to
        build (token lists, hash conversions) is not built on the caller's thread. `make` must
        only read what nobody changes."""
        self._put(make)

    def stored_event(
        self,
        block_hashes: list[ExternalBlockHash],
        parent: ExternalBlockHash | None,
        token_ids: list[int],
        block_size: int,
        medium: str,
    ) -> Any:
        return self._stored_cls(
            block_hashes=block_hashes,
            parent_block_hash=parent,
            token_ids=token_ids,
            block_size=block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )

    def removed_events(self, block_hashes: list[ExternalBlockHash], medium: str) -> list[Any]:
        """One BlockRemoved per 4096 hashes."""
        return [
            self._removed_cls(
                block_hashes=block_hashes[i : i + _MAX_HASHES_PER_EVENT], medium=medium
            )
            for i in range(0, len(block_hashes), _MAX_HASHES_PER_EVENT)
        ]

    def _put(self, item: Any) -> None:
        with self._cond:
            if self._closing or self._dead:
                self.dropped_events += 1
                return
            self._pending.append(item)
            self._queued += 1

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (the thread is already awake) or closed (closing)
            pass

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get (batches sent so far)."""
        with self._cond:
            return self._next_seq

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until every event queued before the call has been sent (within a
        `batch_interval`). False on timeout, or when the thread has stopped with events
        unsent."""
        with self._cond:
            target = self._queued
        self._wake()
        with self._cond:
            self._cond.wait_for(lambda: self._sent >= target or self._dead, timeout)
            return self._sent >= target

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        with self._cond:
            already = self._closing
            self._closing = True
        if not already:
            self._wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._wake_r.close()
            self._wake_w.close()

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        assert self._pub is not None
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                ready = dict(poller.poll(self._interval_ms))
                self.wakeups += 1
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                if self._wake_r.fileno() in ready:  # a plain socket is reported by its fd
                    self._drain_wake()
                with self._cond:
                    items, self._pending = self._pending, []
                    closing = self._closing
                self._publish_items(encoder, items)
                if closing:
                    with self._cond:
                        if not self._pending:
                            break
        except Exception:
            _logger.exception("KV event publisher thread failed; no more events are sent")
        finally:
            self._close_sockets(linger=None)
            with self._cond:
                self._dead = True
                self._cond.notify_all()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass

    def _publish_items(self, encoder: msgspec.msgpack.Encoder, items: list[Any]) -> None:
        """Expand deferred items and send the events in batches of at most `max_batch`."""
        events: list[Any] = []
        for item in items:
            if not callable(item):
                events.append(item)
                continue
            try:
                events += item()
            except Exception:  # a bug in a deferred item must not stop the thread
                self.errors += 1
                _logger.exception("a deferred KV event failed; dropped")
        for start in range(0, len(events), self._max_batch):
            self._publish(encoder, events[start : start + self._max_batch])
        with self._cond:  # one per queued item, however many events it made
            self._sent += len(items)
            self._cond.notify_all()

    def _publish(self, encoder: msgspec.msgpack.Encoder, events: list[Any]) -> None:
        assert self._pub is not None
        batch = EventBatch(ts=time.time(), events=events, data_parallel_rank=self._dp_rank)
        try:
            payload = encoder.encode(batch)
        except Exception:  # a bug here must not stop the thread: drop the batch, say so
            self.errors += 1
            _logger.exception("KV event batch of %d events not encoded; dropped", len(events))
            return
        seq = self._next_seq
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            self.errors += 1
            _logger.exception("KV event batch %d not sent (still kept for replay)", seq)
        self._buffer.append((seq, payload))
        with self._cond:
            self._next_seq = seq + 1
            self.published_batches += 1

    def _serve_replay(self) -> None:
        """Answer every waiting replay request: `[identity, b"", start]` from a REQ socket (as
        vLLM's) or `[identity, start]` from a DEALER that sends no delimiter; the answer keeps
        the request's envelope."""
        replay = self._replay
        assert replay is not None
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 3 and frames[1] == b"":
                envelope, start = frames[:2], frames[2]
            elif len(frames) == 2:
                envelope, start = frames[:1], frames[1]
            else:
                self.errors += 1
                continue
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    replay.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
            replay.send_multipart([*envelope, END_SEQ, b""])

    def _close_sockets(self, *, linger: int | None) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=linger)


# ------------------------------------------------------------------------------ the tree side


class TreeKVEvents:
    """The tree's `TreeObserver` (and a listener on the cache's event log) that publishes where
    pages enter and leave each tier.

    GPU and CPU follow the tree exactly: a node gaining its device copy (insert, load-back) or
    a complete host copy (end of a backup, a prefetch inserted) is one `BlockStored` of its
    pages with their tokens and the hash of the page before; losing it (eviction, demotion, a
    failed load's revert, exclusive mode's `drop_host`, removal) one `BlockRemoved`; `clear` one
    `AllBlocksCleared`. STORAGE is what this cache knows of L3: pages an upload stored in full
    (`uploader.stored`, whose `last_hash` names the chain's last page) and pages a prefetch read
    from it are stored; `clear_storage()` removes them all; nothing else is (docs/kv-events.md).

    Every call runs on the thread that changes the tree (the tree actor's), inside the tree's
    call: it reads the node, computes its page hashes if the tree has not cached them yet
    (caching them with `set_page_hashes`, as the tree actor does before an upload), and queues
    the event; encoding and sending are the publisher thread's.
    """

    def __init__(
        self,
        tree: RadixTree,
        publisher: KVEventPublisher,
        *,
        log: EventLog | None = None,
        block_hash: Literal["int", "bytes"] = "int",
    ) -> None:
        if tree.observer is not None:
            raise ValueError("the tree already has an observer")
        if block_hash not in ("int", "bytes"):
            raise ValueError(f"block_hash={block_hash!r} must be 'int' or 'bytes'")
        self._tree = tree
        self.publisher = publisher
        self._form: Literal["int", "bytes"] = block_hash
        self._ps = tree.page_size
        self._lock = threading.RLock()
        self._held: dict[str, set[str]] = {m: set() for m in MEDIUMS}  # page hashes per medium
        # Every page on GPU or CPU: hash -> (hash of the page before, its tokens), to publish
        # an upload's pages (named by the chain's last hash) as STORAGE.
        self._pages: dict[str, tuple[str | None, np.ndarray]] = {}
        self.errors = 0
        self._log = log
        tree.observer = self
        if log is not None:
            log.add_listener(self._on_log_event)

    def close(self) -> None:
        """Stop observing, then send what is queued and close the publisher."""
        if self._tree.observer is self:
            self._tree.observer = None
        if self._log is not None:
            self._log.remove_listener(self._on_log_event)
        self.publisher.close()

    def flush(self, timeout: float | None = 10.0) -> bool:
        return self.publisher.flush(timeout)

    def held(self, medium: str) -> frozenset[str]:
        """The page hashes (hex) this side has published as held in `medium`."""
        with self._lock:
            return frozenset(self._held[medium])

    # ---------------------------------------------------------------- TreeObserver
    def node_gained(self, node: NodeId, tier: str, how: str) -> None:
        try:
            with self._lock:
                medium = _TIER_MEDIUM[tier]
                hashes, prior, tokens = self._node_pages(node)
                ps = self._ps
                for i, h in enumerate(hashes):
                    if h not in self._pages:
                        self._pages[h] = (
                            prior if i == 0 else hashes[i - 1],
                            tokens[i * ps : (i + 1) * ps],
                        )
                self._store(medium, hashes, prior, tokens)
                if how == "insert_host":  # prefetched: read from L3, so L3 has it
                    self._store(STORAGE, hashes, prior, tokens)
        except Exception:  # never into the tree's call
            self.errors += 1
            _logger.exception("KV events: node_gained failed; the published view may be off")

    def node_lost(self, node: NodeId, tier: str) -> None:
        try:
            with self._lock:
                medium = _TIER_MEDIUM[tier]
                hashes = self._hashes(node)
                held = self._held[medium]
                gone = [h for h in hashes if h in held]
                held.difference_update(gone)
                if gone:
                    self.publisher.defer(partial(self._removed_events, tuple(gone), medium))
                for h in gone:
                    if h not in self._held[GPU] and h not in self._held[CPU]:
                        self._pages.pop(h, None)
        except Exception:  # never into the tree's call
            self.errors += 1
            _logger.exception("KV events: node_lost failed; the published view may be off")

    def tree_cleared(self) -> None:
        try:
            with self._lock:
                for held in self._held.values():
                    held.clear()
                self._pages.clear()
                self.publisher.all_cleared()
        except Exception:  # never into the tree's call
            self.errors += 1
            _logger.exception("KV events: tree_cleared failed; the published view may be off")

    # ---------------------------------------------------------------- the event log
    def _on_log_event(self, event: dict[str, Any]) -> None:
        name = event.get("event")
        if name not in ("uploader.stored", "tree.storage_cleared", "storage.detached"):
            return
        try:
            self._storage_event(name, event)
        except Exception:  # the log would swallow it silently
            self.errors += 1
            _logger.exception("KV events: %s failed; the published view may be off", name)

    def _storage_event(self, name: str, event: dict[str, Any]) -> None:
        if name == "uploader.stored":
            last, pages = event.get("last_hash"), event.get("pages")
            if isinstance(last, str) and isinstance(pages, int):
                with self._lock:
                    self._uploaded(last, pages)
        else:  # tree.storage_cleared, storage.detached: L3 holds nothing this cache can read
            with self._lock:
                gone = sorted(self._held[STORAGE])
                self._held[STORAGE].clear()
                if gone:
                    self.publisher.defer(partial(self._removed_events, tuple(gone), STORAGE))

    def _uploaded(self, last: str, pages: int) -> None:
        """An upload stored `pages` pages ending with `last`: they are still on CPU (the tree
        keeps them host-protected until it applies the upload), so walk their parents."""
        chain: list[str] = []
        h: str | None = last
        while h is not None and len(chain) < pages and h in self._pages:
            chain.append(h)
            h = self._pages[h][0]
        if not chain:
            return
        chain.reverse()
        tokens = np.concatenate([self._pages[x][1] for x in chain])
        self._store(STORAGE, tuple(chain), h, tokens)

    # ---------------------------------------------------------------- helpers
    def _store(
        self, medium: str, hashes: Sequence[str], prior: str | None, tokens: np.ndarray
    ) -> None:
        """One BlockStored per run of pages not yet held in `medium` (normally one: all)."""
        held = self._held[medium]
        ps = self._ps
        for start, end in _runs([h not in held for h in hashes]):
            parent = prior if start == 0 else hashes[start - 1]
            chain = tuple(hashes[start:end])
            page_tokens = tokens[start * ps : end * ps]  # read-only: the node key's bytes
            self.publisher.defer(partial(self._stored_events, chain, parent, page_tokens, medium))
            held.update(chain)

    # Run on the publisher's thread, over immutable inputs.
    def _stored_events(
        self, chain: tuple[str, ...], parent: str | None, tokens: np.ndarray, medium: str
    ) -> list[Any]:
        wire = self._wire
        return [
            self.publisher.stored_event(
                [wire(h) for h in chain],
                None if parent is None else wire(parent),
                tokens.tolist(),
                self._ps,
                medium,
            )
        ]

    def _removed_events(self, gone: tuple[str, ...], medium: str) -> list[Any]:
        return self.publisher.removed_events([self._wire(h) for h in gone], medium)

    def _node_pages(self, node: NodeId) -> tuple[tuple[str, ...], str | None, np.ndarray]:
        """The node's page hashes, the hash of the page before them (None at the root) and
        its tokens (the first id of each pair for bigram keys)."""
        tree = self._tree
        hashes = self._hashes(node)
        parent = tree.parent(node)
        prior: str | None
        if parent is None or tree.is_root(parent):  # a salt's chain starts at its seed
            prior = None if parent is None else tree.seed(parent)
        else:
            prior = self._hashes(parent)[-1]
        tokens = np.asarray(tree.key(node))
        if tokens.ndim == 2:
            tokens = tokens[:, 0]
        return hashes, prior, tokens

    def _hashes(self, node: NodeId) -> tuple[str, ...]:
        """The tree's cached page hashes of `node`, computed (and cached) top-down from the
        nearest ancestor that has them, as the tree actor computes them for L3 keys."""
        tree = self._tree
        cached = tree.page_hashes(node)
        if cached is not None:
            return tuple(cached)
        todo = [node]
        up = tree.parent(node)
        while up is not None and not tree.is_root(up) and tree.page_hashes(up) is None:
            todo.append(up)
            up = tree.parent(up)
        if up is None or tree.is_root(up):
            prior = None if up is None else tree.seed(up)
        else:
            above = tree.page_hashes(up)
            prior = None if not above else above[-1]
        for n in reversed(todo):
            computed = chain_page_hashes(tree.key(n), self._ps, prior=prior)
            tree.set_page_hashes(n, computed)
            prior = computed[-1]
        return tuple(tree.page_hashes(node) or ())

    def _wire(self, page_hash: str) -> ExternalBlockHash:
        return external_block_hash(page_hash, self._form)


def _runs(flags: Sequence[bool]) -> Iterator[tuple[int, int]]:
    """(start, end) of every maximal run of True in `flags`."""
    start = None
    for i, flag in enumerate(flags):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            yield start, i
            start = None
    if start is not None:
        yield start, len(flags)


def start_kv_events(
    config: CacheConfig, tree: RadixTree, log: EventLog | None = None
) -> TreeKVEvents | None:
    """Publish `tree`'s tier changes as `config` says (`kv_events`, `kv_events_replay`,
    `kv_events_topic`, `kv_events_buffer`, `kv_events_format`), with STORAGE events taken from
    `log` (the cache's kernel log). None when `kv_events` is unset, and on TP ranks other than
    0 (every rank's tree is the same: one publishes). `close()` the result after the kernel
    has stopped; binding an endpoint that is taken raises `zmq.ZMQError` here."""
    if config.kv_events is None or config.tp_rank != 0:
        return None
    encoding: Literal["map", "array"] = "array" if config.kv_events_format == "array" else "map"
    publisher = KVEventPublisher(
        config.kv_events,
        replay_endpoint=config.kv_events_replay,
        topic=config.kv_events_topic,
        buffer_steps=config.kv_events_buffer,
        encoding=encoding,
    )
    try:
        return TreeKVEvents(tree, publisher, log=log)
    except BaseException:
        publisher.close()
        raise
