"""hicache's storage backends as SGLang HiCache's L3 (`HiCacheStorage`), loaded by SGLang's
dynamic backend loader with no change to SGLang:

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "hicache",
            "module_path": "hicache.integrations.sglang", "class_name": "HiCacheL3Storage",
            "interface_v1": 1, "storage": "file:/var/cache/hicache"}'

Any hicache storage spec works (`file:`, `memory`, Redis / Valkey, Mooncake, NIXL, AIBrix;
sealed or encrypted with a secret); every value is framed and checksummed, and a read that
fails its check is a miss. Options: docs/sglang.md.

Modules: storage.py (the `HiCacheStorage` subclass), pages.py (a host pool's pages as byte
ranges, and the namespace of its values), options.py (the extra config), compat.py (SGLang's
types, or stand-ins without SGLang).
"""

from __future__ import annotations

from hicache.integrations.sglang.options import StorageOptions, parse_options
from hicache.integrations.sglang.pages import PageMap, pool_namespace, storage_hash
from hicache.integrations.sglang.storage import HiCacheL3Storage

__all__ = [
    "HiCacheL3Storage",
    "PageMap",
    "StorageOptions",
    "parse_options",
    "pool_namespace",
    "storage_hash",
]
