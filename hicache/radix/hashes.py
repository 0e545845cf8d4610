"""Page hashes: the chained SHA-256 that names each whole page of a key, wherever it is stored.

A page's hash encodes its whole prefix: `h_i = SHA256(h_{i-1} || tokens of page i)`, where
`h_{-1}` is empty (or a given prior hash, as raw 32 bytes) and each token id is 4 bytes
little-endian; for bigram (tuple) tokens each tuple contributes its ids in order. Equal tokens
at different positions or after different prefixes therefore get different hashes. A salted
key's chain starts from `salt_seed(salt)`.

The tree keeps these per node (`TreeStructure.page_hashes`); a store's key for a page is its
namespace plus the hash (hicache/backends/keys.py). Pure functions only; the digest loop may be
handed a compiled one (`use_digest_loop`, hicache/kernels/native/pagehash.py: the same
digests from the same libcrypto, without a Python call per page).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

from hicache.types import PageHash

__all__ = ["chain_page_hashes", "page_hash_bytes", "salt_seed"]

_HASH_RE = re.compile(r"[0-9a-f]{64}")

DigestLoop = Callable[[bytes, bytes, int, int], bytes]
"""(prior digest or b"", the pages' bytes, bytes per page, pages) -> the chained digests."""

_DIGEST_LOOP: list[DigestLoop | None] = [None]  # the process's, set by `use_digest_loop`


def use_digest_loop(loop: DigestLoop | None) -> None:
    """Chain digests with `loop` from now on in this process (None: the Python loop). It must
    give hashlib's SHA-256 chain byte for byte; an OSError from it falls back per call."""
    _DIGEST_LOOP[0] = loop


def digest_loop() -> DigestLoop | None:
    """The digest loop in use (None: the Python loop)."""
    return _DIGEST_LOOP[0]


def _python_digests(prior: bytes, raw: bytes, stride: int, pages: int) -> bytes:
    sha256 = hashlib.sha256
    digests: list[bytes] = []
    prev = prior
    for start in range(0, pages * stride, stride):
        prev = sha256(prev + raw[start : start + stride]).digest()
        digests.append(prev)
    return b"".join(digests)


def salt_seed(salt: bytes) -> PageHash:
    """What a salt's page hash chain starts from (the empty salt starts from nothing, so its
    L3 keys are those of a cache without salts): equal salts give equal keys on every
    instance, so instances of one tenant share a store."""
    return PageHash(hashlib.sha256(b"hicache salt\0" + salt).hexdigest())


def chain_page_hashes(
    tokens: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
    page_size: int,
    *,
    prior: PageHash | None = None,
) -> list[PageHash]:
    """The chained hash of every whole page of `tokens` (a trailing partial page gets none).

    `tokens` is a 1-D sequence of token ids, or for bigram keys a sequence of equal-length
    tuples (a 2-D array). `prior` is the hash of the page just before `tokens[0]`. Pure.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    prior_bytes = b"" if prior is None else page_hash_bytes(prior, "prior")
    ids = _as_token_array(tokens)
    pages = ids.shape[0] // page_size
    if pages == 0:
        return []
    # One conversion for the whole run; per page one SHA-256 call over (previous digest +
    # the page's bytes), and the digests turned to hex all at once: the Python work per page
    # is what bounds this loop, not the hashing.
    raw = np.ascontiguousarray(ids[: pages * page_size], dtype="<u4").tobytes()
    stride = len(raw) // pages
    loop = _DIGEST_LOOP[0]
    digests = b""
    if loop is not None:
        try:
            digests = loop(prior_bytes, raw, stride, pages)
        except OSError:
            digests = b""
    if not digests:
        digests = _python_digests(prior_bytes, raw, stride, pages)
    hexed = digests.hex()
    return cast(list[PageHash], [hexed[i : i + 64] for i in range(0, 64 * pages, 64)])


def page_hash_bytes(value: str, what: str) -> bytes:
    """The 32 raw bytes of a page hash; ValueError naming `what` unless it is 64 lowercase hex."""
    if not isinstance(value, str) or not _HASH_RE.fullmatch(value):
        raise ValueError(f"{what} must be a 64-character lowercase hex SHA-256, got {value!r}")
    return bytes.fromhex(value)


def _as_token_array(tokens: object) -> np.ndarray:
    try:
        ids = np.asarray(tokens)
    except ValueError as exc:  # ragged tuples
        raise ValueError(f"tokens must be ids or equal-length tuples of ids: {exc}") from None
    if ids.size == 0:
        return ids.reshape(0)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    if ids.ndim not in (1, 2):
        raise ValueError(f"tokens must be 1-D (ids) or 2-D (bigram tuples), got {ids.ndim}-D")
    if ids.ndim == 2 and ids.shape[1] == 0:
        raise ValueError("bigram tuples must not be empty")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi > 0xFFFFFFFF:
        raise ValueError(f"token ids must fit in 32 bits unsigned, got range [{lo}, {hi}]")
    return ids
