"""`file:DIR`, the embedded default L3: one file per page value.

- backend.py: `FileBackend`, the StorageBackend, and the on-disk layout (`value_path`);
- index.py: which values the store holds, how big, how recently used, until when;
- io.py: the blocking per-page system calls, in Python (the reference and the fallback);
- native.py: the same loops compiled from fileio.c, used where they build.
"""

from hicache.backends.file.backend import FileBackend, value_path

__all__ = ["FileBackend", "value_path"]
