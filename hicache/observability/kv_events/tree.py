"""`TreeKVEvents`: a `RadixTree`'s tier changes and the cache's L3 events as KV events, and
`start_kv_events`, which wires one from a `CacheConfig`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from hicache.observability.kv_events.publisher import KVEventPublisher
from hicache.observability.kv_events.wire import (
    CPU,
    GPU,
    MEDIUMS,
    STORAGE,
    ExternalBlockHash,
    external_block_hash,
)
from hicache.radix.hashes import chain_page_hashes

if TYPE_CHECKING:
    from hicache.config import CacheConfig
    from hicache.observability.events import EventLog
    from hicache.radix.tree import RadixTree
    from hicache.types import NodeId

_logger = logging.getLogger("hicache.kv_events")

_TIER_MEDIUM = {"device": GPU, "host": CPU}


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
    `log` (the cache's event log). None when `kv_events` is unset, and on TP ranks other than
    0 (every rank's tree is the same: one publishes). `close()` the result after the actor system
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
