"""Distinct id types. Components hold ids, never references to another component's objects."""

from __future__ import annotations

from typing import NewType

NodeId = NewType("NodeId", int)
"""A radix-tree node, unique for the life of one tree (never reused)."""

RequestId = NewType("RequestId", str)
"""A serving-engine request, chosen by the engine."""

OpId = NewType("OpId", int)
"""One in-flight operation (a write, a load, a prefetch, an upload), unique per kernel."""

DeviceSlot = NewType("DeviceSlot", int)
"""A token slot in the device (L1) KV pool."""

HostSlot = NewType("HostSlot", int)
"""A token slot in the host (L2) KV pool."""

PageHash = NewType("PageHash", str)
"""The chained SHA-256 of one page (hex), without namespace; the L3 key is namespace + hash."""
