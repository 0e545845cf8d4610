"""Match and insert: walking a key down the tree, page by page, splitting where it ends inside a
node, and hanging what is new below as one leaf (device slots from ``insert``, host slots from
``insert_host``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache.components.tree.node import Node
from hicache.components.tree.returns import InsertHostResult, InsertResult, MatchResult, TreeError
from hicache.components.tree.slot_arrays import concat, frozen_slots
from hicache.components.tree.structure import TreeStructure
from hicache.policies.write import WritePolicy
from hicache.types import EMPTY_SLOTS, NodeId, PageHash

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """The tree's match and insert, over its `TreeStructure` (``RadixTree`` owns one of each)."""

    def __init__(self, structure: TreeStructure) -> None:
        self._s = structure
        self._codec = structure.codec
        self._root = structure.root  # never removed
        self._stage = bytearray()  # scratch copy of the key being walked, for memcmp against keys

    def descend(self, start: Node, key: np.ndarray, n: int, now: float) -> tuple[list[Node], int]:
        """Walk from ``start`` along ``key[:n]`` (n whole pages), comparing whole node keys with memcmp.
        Splits the last node if the key ends or differs inside it; stamps ``now`` on every node passed.
        Returns the nodes passed below ``start`` and the tokens they cover. Mutates (stamps, split)."""
        path: list[Node] = []
        codec = self._codec
        ps = codec.page_size
        if n == 0:
            return path, 0
        child = start.children.get(key[:ps].tobytes())
        if child is None:
            return path, 0
        isz = codec.itemsize
        end = n * isz
        if len(self._stage) < end:
            self._stage = bytearray(max(end, 2 * len(self._stage)))
        stage = self._stage
        staged = 0  # bytes of the key copied into the stage so far (copied lazily, as compared)
        pos = 0  # bytes matched
        while True:
            ck = child.key
            stop = pos + len(ck)
            if stop > staged and staged < end:
                upto = min(stop, end)
                count = (upto - staged) // isz
                np.frombuffer(stage, dtype=codec.dtype, count=count, offset=staged)[:] = key[
                    staged // isz : upto // isz
                ]
                staged = upto
            if stop <= end and stage.startswith(ck, pos, end):
                pos = stop
                child.last_access = now
                path.append(child)
            else:
                rest = child  # keeps its id and the part past the match
                child = self._s.split(child, codec.common_tokens(ck, key[:n], pos // isz))
                pos += child.num_tokens * isz
                child.last_access = now
                rest.last_access = now  # as SGLang: a split refreshes the suffix too
                path.append(child)
                break
            if pos >= end:
                break
            t = pos // isz
            nxt = child.children.get(key[t : t + ps].tobytes())
            if nxt is None:
                break
            child = nxt
        return path, pos // isz

    def match(self, key: Sequence[Any] | np.ndarray, now: float, salt: bytes) -> MatchResult:
        """``RadixTree.match``."""
        arr = self._codec.encode(key)
        start = self._s.root_of(salt, create=False)
        if start is None:  # nothing was ever cached under this salt
            return MatchResult(device_slots=EMPTY_SLOTS, host_len=0, last_node=self._root.id)
        path, _ = self.descend(start, arr, arr.size - arr.size % self._codec.page_size, now)
        device_parts = []
        host_len = 0
        for x in path:
            if x.device is not None:
                device_parts.append(x.device)
            else:
                host_len += x.num_tokens
        return MatchResult(
            device_slots=concat(device_parts),
            host_len=host_len,
            last_node=path[-1].id if path else self._root.id,  # never a salt's root
        )

    def insert(
        self,
        key: Sequence[Any] | np.ndarray,
        device_slots: np.ndarray,
        now: float,
        chunked: bool,
        priority: int | None,
        write_policy: WritePolicy,
        salt: bytes,
        *,
        backup: bool = False,
    ) -> InsertResult:
        """``RadixTree.insert``."""
        arr = self._codec.encode(key)
        n = arr.size
        ps = self._codec.page_size
        if n % ps:
            raise TreeError(f"insert: key of {n} tokens is not a multiple of page_size={ps}")
        slots = frozen_slots(device_slots, "insert", n)
        # Chunked-prefill inserts neither count hits nor propose backups (as the seed), unless
        # the caller asks for a backup now (threshold 1: every node without a host copy).
        threshold = 1 if backup else None if chunked else write_policy.backup_threshold
        hit = 0 if chunked else 1
        start = self._s.root_of(salt, create=n > 0) or self._root
        path, matched = self.descend(start, arr, n, now)
        prefix_len = 0
        pos = 0
        candidates: list[NodeId] = []
        for x in path:
            if x.device is None:
                # Recomputed KV for a host-only node: adopt the caller's slots (top-down, so the
                # evicted-suffix invariant holds).
                self._s.set_device(x, slots[pos : pos + x.num_tokens], "insert")
            else:
                prefix_len = pos + x.num_tokens
                x.hit_count += hit
                if (
                    threshold is not None
                    and x.host is None
                    and (backup or x.hit_count >= threshold)
                ):
                    candidates.append(x.id)
            if priority is not None and priority > x.priority:
                x.priority = priority
            pos += x.num_tokens
        node = path[-1] if path else start
        if matched < n:
            leaf_slots = slots[matched:]
            if matched:  # a view would keep the caller's whole array (duplicates included) alive
                leaf_slots = leaf_slots.copy()
                leaf_slots.flags.writeable = False
            leaf = self._s.new_node(
                node,
                arr[matched:].tobytes(),
                n - matched,
                device=leaf_slots,
                host=None,
                now=now,
                priority=self._s.default_priority if priority is None else priority,
            )
            leaf.hit_count = hit
            self._s.attach(leaf)
            if threshold is not None and (backup or leaf.hit_count >= threshold):
                candidates.append(leaf.id)
            node = leaf
        return InsertResult(
            prefix_len=prefix_len,
            duplicate_slots=slots[:prefix_len],
            last_node=node.id,
            backup_candidates=tuple(candidates),
        )

    def insert_host(
        self,
        parent: NodeId,
        key_suffix: Sequence[Any] | np.ndarray,
        host_slots: np.ndarray,
        page_hashes: Sequence[PageHash],
        *,
        now: float,
        salt: bytes,
    ) -> InsertHostResult:
        """``RadixTree.insert_host``."""
        start = self._s.node(parent, "insert_host parent")
        arr = self._codec.encode(key_suffix)
        n = arr.size
        if start is self._root and salt:  # nothing of the salt was matched: below its root
            start = self._s.root_of(salt, create=n > 0) or self._root
        ps = self._codec.page_size
        if n % ps:
            raise TreeError(
                f"insert_host: suffix of {n} tokens is not a multiple of page_size={ps}"
            )
        slots = frozen_slots(host_slots, "insert_host", n)
        hashes = tuple(page_hashes)
        if len(hashes) != n // ps:
            raise TreeError(f"insert_host: {len(hashes)} page hashes for {n // ps} pages")
        path, matched = self.descend(start, arr, n, now)
        node = path[-1] if path else start
        if matched < n:
            leaf = self._s.new_node(
                node,
                arr[matched:].tobytes(),
                n - matched,
                device=None,
                host=slots[matched:],
                now=now,
                priority=self._s.default_priority,
            )
            leaf.hashes = hashes[matched // ps :]
            self._s.attach(leaf)
            node = leaf
        return InsertHostResult(
            matched_len=matched,
            duplicate_slots=slots[:matched],
            last_node=self._root.id if node.parent is None else node.id,
        )
