"""Helpers shared by the Redis backend tests (imported by name: the folder is on sys.path)."""

from __future__ import annotations

from hicache.backends.keys import Namespace
from hicache.testing.conformance import KV, Events, Pages, page_keys

__all__ = ["KV", "Events", "Pages", "namespace", "page_keys"]


def namespace(tenant: str = "", kv: str = KV, page_size: int = 4) -> Namespace:
    return Namespace(model="test/redis-model", kv=kv, page_size=page_size, tenant=tenant)
