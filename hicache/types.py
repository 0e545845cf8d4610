"""Distinct id types, and the one empty slot array. Components hold ids, never references to
another component's objects."""

from __future__ import annotations

from typing import NewType

import numpy as np

NodeId = NewType("NodeId", int)
"""A radix-tree node, unique for the life of one tree (never reused)."""

RequestId = NewType("RequestId", str)
"""A serving-engine request, chosen by the engine."""

OpId = NewType("OpId", int)
"""One in-flight operation (a write, a load, a prefetch, an upload), unique per actor system."""

PageHash = NewType("PageHash", str)
"""The chained SHA-256 of one page (hex), without namespace; the L3 key is namespace + hash."""

EMPTY_SLOTS = np.empty(0, dtype=np.int64)
"""No slots: a read-only int64 array of length 0, shared by every place that needs one (slot
arrays are read-only int64 throughout, as the ledgers hand them out)."""
EMPTY_SLOTS.flags.writeable = False
