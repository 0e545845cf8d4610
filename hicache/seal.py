"""What a secret adds to L3: keyed names, an authenticated seal on every value, encryption.

With a `Seal` in its `Namespace` (hicache/backends/keys.py), a cache's L3 keys are HMAC-SHA-256 under keys
derived from the secret (HKDF-SHA-256): the namespace digest is
`HMAC(k_names, "namespace" || fields)` and a page's key suffix
`HMAC(k_names, "page" || digest || page hash)`, so someone who can list or read the store can
neither test whether a prompt is cached nor compute the key to plant a value under. The tree's
chained page hashes (hicache/radix/hashes.py) are unchanged; only their names in the store are.

Each value's payload then starts with a seal block (after the framing header, hicache/backends/framing.py):

    magic "HKS1" | mode u8 (1 tag, 2 AES-256-GCM) | 3 zero bytes | nonce 12 B | tag 32 B

The tag covers the block's mode and nonce, the key the value was written under, the payload's
length and the payload: mode 1 is HMAC-SHA-256 under `k_tags` over the plaintext page; mode 2
encrypts the page with AES-256-GCM (the `cryptography` package, the `crypto` extra) under a key
derived per namespace with HKDF from the secret, a random 96-bit nonce per value and the
16-byte GCM tag (zero-padded). A value whose block or tag does not verify raises `SealError`,
which the sealed backend (hicache/backends/sealing/backend.py) turns into a miss and a
`storage.corrupt` event. A value object and pure functions (the configuration builds a `Seal`),
so this module sits in the core, below the backends.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from typing import Any

SEAL_MAGIC = b"HKS1"
MODE_TAG = 1
MODE_AES_GCM = 2
_BLOCK = struct.Struct("<4sB3x12s32s")
SEAL_SIZE = _BLOCK.size
"""Bytes of the seal block in front of every sealed page (52)."""
MIN_SECRET_BYTES = 16
_HKDF_SALT = b"hicache-seal-v1"
_NO_NONCE = bytes(12)

Pieces = Sequence[memoryview | bytes]


def hkdf_sha256(ikm: bytes, *, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA-256 (RFC 5869): extract with `salt`, expand with `info` to `length` bytes."""
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
    return out[:length]


class SealError(Exception):
    """A sealed value that must not be used. `reason`: "seal" (no or another kind of seal
    block) or "tag" (forged, altered, or written under another secret)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"sealed page value rejected ({reason}): {detail}")
        self.reason = reason


def crypto_missing() -> str | None:
    """Why encryption at rest cannot run here (None: it can)."""
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher  # noqa: F401
    except ImportError as exc:
        return f"it needs the `cryptography` package (pip install 'hicache[crypto]'): {exc}"
    return None


def _gcm(key: bytes, nonce: bytes, tag: bytes | None = None) -> Any:
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    return Cipher(algorithms.AES(key), modes.GCM(nonce, tag, min_tag_length=16))


class Seal:
    """Keys derived from one secret; the secret itself is not kept. Immutable; equal seals
    come from equal secrets and modes. Its repr shows the mode only."""

    __slots__ = ("_names", "_root", "_tags", "encrypt", "fingerprint")

    def __init__(self, secret: bytes, *, encrypt: bool = False) -> None:
        if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a seal's secret must be at least {MIN_SECRET_BYTES} bytes")
        if encrypt and (why := crypto_missing()):
            raise ValueError(f"encryption at rest is not available: {why}")
        self.encrypt = bool(encrypt)
        self._names = hkdf_sha256(secret, salt=_HKDF_SALT, info=b"names")
        self._tags = hkdf_sha256(secret, salt=_HKDF_SALT, info=b"tags")
        self._root = hkdf_sha256(secret, salt=_HKDF_SALT, info=b"at-rest")
        # Tells seals apart (equality, logs) without saying anything about the secret.
        self.fingerprint = hkdf_sha256(secret, salt=_HKDF_SALT, info=b"fingerprint", length=8).hex()

    def __repr__(self) -> str:
        return f"Seal(encrypt={self.encrypt})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Seal):
            return NotImplemented
        return (self.fingerprint, self.encrypt) == (other.fingerprint, other.encrypt)

    def __hash__(self) -> int:
        return hash((self.fingerprint, self.encrypt))

    def __setattr__(self, name: str, value: object) -> None:
        if hasattr(self, "fingerprint"):
            raise AttributeError("Seal is immutable")
        object.__setattr__(self, name, value)

    @property
    def mode(self) -> int:
        return MODE_AES_GCM if self.encrypt else MODE_TAG

    def namespace_digest(self, fields: bytes) -> str:
        """The 20-hex namespace digest of the serialised namespace fields (and the mode)."""
        blob = b"namespace\0" + bytes([self.mode]) + fields
        return hmac.new(self._names, blob, hashlib.sha256).hexdigest()[:20]

    def page_name(self, digest: str, page_hash: bytes) -> str:
        """The 64-hex key suffix of a page (its raw 32-byte chained hash) in `digest`."""
        blob = b"page\0" + digest.encode() + b"\0" + page_hash
        return hmac.new(self._names, blob, hashlib.sha256).hexdigest()

    def value_key(self, digest: str) -> bytes:
        """The AES-256 key of namespace `digest` (HKDF from the secret, per namespace)."""
        return hkdf_sha256(self._root, salt=_HKDF_SALT, info=b"aes-256-gcm\0" + digest.encode())

    def seal(self, key: str, pieces: Pieces, value_key: bytes | None = None) -> list[Any]:
        """The pieces to store for a page: the seal block, then the page (mode 1) or its
        ciphertext (mode 2, `value_key` from `value_key()`)."""
        length = sum(memoryview(p).nbytes for p in pieces)
        if not self.encrypt:
            tag = self._tag(_aad(MODE_TAG, _NO_NONCE, key, length), pieces)
            return [_BLOCK.pack(SEAL_MAGIC, MODE_TAG, _NO_NONCE, tag), *pieces]
        assert value_key is not None, "encrypting needs the namespace's value key"
        nonce = os.urandom(12)
        enc = _gcm(value_key, nonce).encryptor()
        enc.authenticate_additional_data(_aad(MODE_AES_GCM, nonce, key, length))
        out = [enc.update(p) for p in pieces]
        enc.finalize()
        return [_BLOCK.pack(SEAL_MAGIC, MODE_AES_GCM, nonce, enc.tag.ljust(32, b"\0")), *out]

    def open(
        self,
        key: str,
        block: bytes | memoryview,
        stored: Pieces,
        pieces: Sequence[memoryview],
        value_key: bytes | None = None,
    ) -> None:
        """Check a read value's seal `block` and its payload `stored` (as read); in mode 2
        decrypt `stored` into `pieces`. Raises SealError; `pieces` hold garbage then."""
        magic, mode, nonce, tag = _BLOCK.unpack(block)
        if magic != SEAL_MAGIC or mode != self.mode:
            raise SealError("seal", f"no mode-{self.mode} seal block in {key!r}")
        length = sum(memoryview(p).nbytes for p in stored)
        aad = _aad(mode, nonce, key, length)
        if not self.encrypt:
            if not hmac.compare_digest(self._tag(aad, stored), tag):
                raise SealError("tag", f"tag mismatch for {key!r}")
            return
        assert value_key is not None, "decrypting needs the namespace's value key"
        if any(tag[16:]):
            raise SealError("tag", f"malformed GCM tag for {key!r}")
        dec = _gcm(value_key, nonce, tag[:16]).decryptor()
        dec.authenticate_additional_data(aad)
        source = memoryview(b"".join(stored) if len(stored) != 1 else stored[0]).cast("B")
        offset = 0
        for piece in pieces:
            n = piece.nbytes
            piece[:] = dec.update(source[offset : offset + n])
            offset += n
        from cryptography.exceptions import InvalidTag

        try:
            dec.finalize()
        except InvalidTag as exc:
            raise SealError("tag", f"authentication failed for {key!r}") from exc

    def _tag(self, aad: bytes, pieces: Pieces) -> bytes:
        mac = hmac.new(self._tags, aad, hashlib.sha256)
        for piece in pieces:
            mac.update(piece)
        return mac.digest()


def _aad(mode: int, nonce: bytes, key: str, length: int) -> bytes:
    """What a tag covers besides the payload: the header's fields, length-prefixed."""
    key_bytes = key.encode()
    return (
        b"hicache-seal\0"
        + SEAL_MAGIC
        + bytes([mode])
        + nonce
        + len(key_bytes).to_bytes(2, "little")
        + key_bytes
        + length.to_bytes(8, "little")
    )
