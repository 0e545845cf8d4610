"""L3 keys: a page's hash (hicache/radix/hashes.py) under a namespace.

A `Namespace` covers everything that shapes the stored bytes (model, attention kind, geometry,
dtype, page size, host layout), a tenant salt, and for MHA the tensor-parallel rank and size, so
no two of those ever share a key. With a `Seal` (hicache/seal.py: a secret), the digest and every
page's key suffix are HMAC-SHA-256 under keys derived from the secret instead, so the store's
names say nothing a reader without the secret can test. Pure functions and immutable values only.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from hicache.radix.hashes import page_hash_bytes
from hicache.seal import Seal
from hicache.types import PageHash

_HEX_DIGITS = b"0123456789abcdef"


def _all_page_hashes(values: Sequence[object]) -> bool:
    """Whether every value is a page hash (a str of 64 lowercase hex digits): a few passes in
    C over the whole batch (a regular expression over it cost 5x as much, per page)."""
    if not values:
        return True
    try:
        if set(map(len, values)) != {64}:  # type: ignore[arg-type]
            return False
        joined = "".join(values)  # type: ignore[arg-type]
        return not joined.encode("ascii").translate(None, _HEX_DIGITS)
    except (TypeError, UnicodeEncodeError):  # a value without a length, not a str, not ASCII
        return False


KEY_SCHEME_VERSION = 2  # 2: MHA namespaces carry tp_size

KV_DTYPES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
}
"""dtype names accepted in a kv spec, with their item sizes."""

_KV_SPEC_RE = re.compile(r"(mha|mla):(\d+):(\d+):(\d+):([a-z0-9_]+)")


def check_kv_spec(spec: str) -> str:
    """Validate `kind:LAYERS:A:B:DTYPE` (MHA: heads and head dim; MLA: kv_lora_rank and
    qk_rope_head_dim) and return it unchanged. Raises ValueError naming what is wrong."""
    m = _KV_SPEC_RE.fullmatch(spec) if isinstance(spec, str) else None
    if m is None:
        raise ValueError(
            f"kv spec {spec!r} must look like mha:LAYERS:HEADS:DIM:DTYPE or "
            "mla:LAYERS:RANK:ROPE:DTYPE (lowercase, e.g. mha:32:8:128:bfloat16)"
        )
    _kind, *dims, dtype = m.groups()
    layers, *sizes = (int(d) for d in dims)  # 0 layers: pages with no K/V (docs/hybrid.md)
    if layers < 0 or any(d <= 0 for d in sizes):
        raise ValueError(f"kv spec {spec!r}: layers must be >= 0 and dimensions positive")
    if dtype not in KV_DTYPES:
        raise ValueError(f"kv spec {spec!r}: unknown dtype {dtype!r}; known: {sorted(KV_DTYPES)}")
    return spec


@dataclass(frozen=True, slots=True, kw_only=True)
class Namespace:
    """Where a cache instance's L3 keys live. Immutable.

    `rank` is this process's tensor-parallel rank (None without TP) and `tp_size` the number
    of ranks (None: 1). MHA keys carry both, since each rank stores its own head shard and
    which heads rank r holds depends on the TP size (with replicated KV heads, rank 0 of TP8
    and rank 0 of TP16 hold different heads); MLA keys carry neither (every rank holds the
    same latent), and only rank 0 (or None) writes them: see `writes`.
    """

    model: str
    kv: str  # e.g. "mha:32:8:128:bfloat16"; see check_kv_spec
    page_size: int
    tenant: str = ""  # salt: tenants with different salts never share a key
    rank: int | None = None
    tp_size: int | None = None
    layout: str = ""  # host layout: the byte order of a stored page depends on it
    seal: Seal | None = field(default=None, repr=False)  # keyed names and sealed values
    digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        check_kv_spec(self.kv)
        if (
            isinstance(self.page_size, bool)
            or not isinstance(self.page_size, int)
            or self.page_size <= 0
        ):
            raise ValueError(f"page_size must be a positive int, got {self.page_size!r}")
        if not isinstance(self.tenant, str):
            raise ValueError(f"tenant salt must be a string, got {self.tenant!r}")
        if self.rank is not None and (
            isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0
        ):
            raise ValueError(f"rank must be None or a non-negative int, got {self.rank!r}")
        if self.tp_size is not None and (
            isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1
        ):
            raise ValueError(f"tp_size must be None or a positive int, got {self.tp_size!r}")
        if self.tp_size is not None and (self.rank or 0) >= self.tp_size:
            raise ValueError(f"rank={self.rank!r} is outside tp_size={self.tp_size!r}")
        if not isinstance(self.layout, str):
            raise ValueError(f"layout must be a string, got {self.layout!r}")
        fields = (
            KEY_SCHEME_VERSION,
            self.model,
            self.kv,
            self.page_size,
            self.tenant,
            self.key_rank,
            self.key_tp_size,
            self.layout,
        )
        if self.seal is not None and not isinstance(self.seal, Seal):
            raise ValueError(f"seal must be None or a Seal, got {type(self.seal).__name__}")
        # Length-prefixed fields so no two field tuples serialise alike.
        blob = b"".join(
            len(b).to_bytes(4, "little") + b for b in (repr(f).encode() for f in fields)
        )
        digest = (
            hashlib.sha256(blob).hexdigest()[:20]
            if self.seal is None
            else self.seal.namespace_digest(blob)
        )
        object.__setattr__(self, "digest", digest)

    @property
    def attention(self) -> str:
        """ "mha" or "mla"."""
        return self.kv.split(":", 1)[0]

    @property
    def key_rank(self) -> int | None:
        """The rank that keys carry: this rank for MHA (0 without TP), None for MLA."""
        return (self.rank or 0) if self.attention == "mha" else None

    @property
    def key_tp_size(self) -> int | None:
        """The TP size that keys carry: for MHA this namespace's (1 without TP), None for MLA."""
        return (self.tp_size or 1) if self.attention == "mha" else None

    @property
    def writes(self) -> bool:
        """Whether this rank uploads: every MHA rank; for MLA only rank 0."""
        return self.attention == "mha" or not self.rank

    @property
    def prefix(self) -> str:
        """The start of every key in this namespace: "hicache:<20 hex digest>:"."""
        return f"hicache:{self.digest}:"

    def key(self, page_hash: PageHash | str) -> str:
        """The full L3 key of one page: the prefix, then the page hash, or with a seal its
        keyed name (HMAC of the digest and the hash)."""
        raw = page_hash_bytes(page_hash, "page_hash")
        if self.seal is None:
            return self.prefix + page_hash
        return self.prefix + self.seal.page_name(self.digest, raw)

    def keys(self, page_hashes: Sequence[PageHash | str]) -> list[str]:
        """`key` of each hash, in order. Every hash is checked as `key` checks it, in one pass
        over the whole batch (one match, not one per page)."""
        if self.seal is not None or not _all_page_hashes(page_hashes):
            return [self.key(h) for h in page_hashes]  # sealed, or a bad hash to name
        prefix = self.prefix
        return [prefix + h for h in page_hashes]

    def page_hashes_of(self, keys: Sequence[str]) -> list[PageHash]:
        """`page_hash_of` of each key (keys already known to be in this namespace), checked in
        one pass over the whole batch; a bad suffix is named as `page_hash_of` names it."""
        start = len(self.prefix)
        rest = [key[start:] for key in keys]
        if not _all_page_hashes(rest):
            return [self.page_hash_of(key) for key in keys]
        return cast(list[PageHash], rest)

    def page_hash_of(self, key: str) -> PageHash:
        """The page hash of a key in this namespace (with a seal: its keyed name, which is
        all a backend needs, e.g. for a file path); ValueError for a foreign key."""
        if not key.startswith(self.prefix):
            raise ValueError(f"key {key!r} is not in namespace {self.prefix!r}")
        rest = key[len(self.prefix) :]
        page_hash_bytes(rest, "key suffix")
        return PageHash(rest)
