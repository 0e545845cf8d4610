"""Prefetch policies: when a request's `prefetch_wait` ends (the tree actor applies them).

- ``best_effort`` (default): at once, with what has arrived; the prefetch is stopped.
- ``wait_complete``: when every page storage had has been read.
- ``timeout``: when complete, or at ``prefetch_timeout_base + prefetch_timeout_per_ki_token x
  tokens / 1024`` after the start, whichever comes first.
"""

from __future__ import annotations

__all__ = ["PREFETCH_POLICIES"]

PREFETCH_POLICIES: tuple[str, ...] = ("best_effort", "wait_complete", "timeout")
