"""Mooncake Store as the L3 tier (`mooncake://`).

- backend.py: `MooncakeBackend`, the StorageBackend, its client and worker threads;
- spec.py: the spec string parsed into a `MooncakeSpec`;
- io.py: the blocking batch operations, one client call per chunk of pages;
- memory.py: the backend's own registered lanes (header slots, staging).
"""

from hicache.backends.mooncake.backend import MooncakeBackend

__all__ = ["MooncakeBackend"]
