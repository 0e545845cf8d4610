"""Shared by the Mooncake tests and their child processes: namespaces and page contents."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

PAGE_BYTES = 64 << 10


@dataclass(frozen=True)
class StandInNamespace:
    """Used only until hicache.backends.keys lands: the two members backends rely on."""

    tenant: str

    @property
    def prefix(self) -> str:
        return (
            "hicache:"
            + hashlib.sha256(b"test-model|" + self.tenant.encode()).hexdigest()[:20]
            + ":"
        )

    def key(self, page_hash: str) -> str:
        return self.prefix + page_hash


def namespace(tenant: str = ""):
    try:
        from hicache.backends.keys import Namespace
    except ImportError:
        return StandInNamespace(tenant)
    return Namespace(model="test-model", kv="mha:2:2:8:float16", page_size=16, tenant=tenant)


def page_hash(i: int, salt: str = "") -> str:
    return hashlib.sha256(f"{salt}page{i}".encode()).hexdigest()


def page_content(i: int, nbytes: int = PAGE_BYTES) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)
