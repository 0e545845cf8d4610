"""A plain-Python radix cache written the usual way: the speed reference for bench/tree.py.

Keys are Python lists compared token by token (page slices at page_size > 1), children keyed by the
first token (or first page as a tuple), values are numpy slot arrays joined on match, and eviction
collects the leaves on every call and pops them from a heap by last access. Only what the benchmark
needs: match, insert, lock/unlock, evict. Not part of the library.
"""

from __future__ import annotations

import heapq

import numpy as np


class RefNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id")

    def __init__(self, node_id: int, parent, key: list, value, now: float) -> None:
        self.id = node_id
        self.children: dict = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = now


class ReferenceRadixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._next_id = 1
        self.root = RefNode(0, None, [], np.empty(0, dtype=np.int64), 0.0)
        self.root.lock_ref = 1

    def _child_key(self, key: list):
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, a: list, b: list) -> int:
        i = 0
        if self.page_size == 1:
            for x, y in zip(a, b):
                if x != y:
                    break
                i += 1
            return i
        ps = self.page_size
        n = min(len(a), len(b))
        while i < n:
            if a[i : i + ps] != b[i : i + ps]:
                break
            i += ps
        return i

    def _split(self, child: RefNode, n: int) -> RefNode:
        new = RefNode(
            self._next_id, child.parent, child.key[:n], child.value[:n], child.last_access
        )
        self._next_id += 1
        new.lock_ref = child.lock_ref
        new.children = {self._child_key(child.key[n:]): child}
        new.parent.children[self._child_key(new.key)] = new
        child.parent = new
        child.key = child.key[n:]
        child.value = child.value[n:]
        return new

    def match(self, key: list, now: float):
        key = key[: len(key) // self.page_size * self.page_size]
        node, values = self.root, []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access = now
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                values.append(node.value)
                break
            values.append(child.value)
            node = child
            key = key[n:]
        value = np.concatenate(values) if values else np.empty(0, dtype=np.int64)
        return value, node

    def insert(self, key: list, value: np.ndarray, now: float) -> int:
        node, prefix = self.root, 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access = now
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            prefix += n
            key = key[n:]
            value = value[n:]
            node = child
        if key:
            new = RefNode(self._next_id, node, key, value.copy(), now)
            self._next_id += 1
            node.children[self._child_key(key)] = new
        return prefix

    def lock(self, node: RefNode) -> None:
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RefNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_tokens: int) -> list[np.ndarray]:
        leaves, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if not n.children:
                if n.lock_ref == 0:
                    leaves.append(n)
            else:
                stack.extend(n.children.values())
        heap = [(n.last_access, n.id, n) for n in leaves]
        heapq.heapify(heap)
        freed, total = [], 0
        while total < num_tokens and heap:
            _, _, n = heapq.heappop(heap)
            freed.append(n.value)
            total += len(n.value)
            parent = n.parent
            del parent.children[self._child_key(n.key)]
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed
