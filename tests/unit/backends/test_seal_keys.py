"""Keyed page names (keys.Namespace with a seal.Seal): without a secret the keys are exactly
today's, with one they are HMACs that say nothing about the prompt and differ per secret."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from hicache.backends.keys import KEY_SCHEME_VERSION, Namespace
from hicache.radix.hashes import chain_page_hashes
from hicache.seal import Seal, SealError, hkdf_sha256

SECRET = b"a-secret-of-at-least-16-bytes"
OTHER = b"another-secret-of-16-bytes+"
FIELDS = dict(model="test/model", kv="mha:2:2:4:bfloat16", page_size=4, tenant="t", layout="x")


def _todays_digest(ns: Namespace) -> str:
    """The unkeyed digest as KEY_SCHEME_VERSION 2 defines it, computed independently."""
    h = hashlib.sha256()
    for f in (KEY_SCHEME_VERSION, ns.model, ns.kv, ns.page_size, ns.tenant, 0, 1, ns.layout):
        b = repr(f).encode()
        h.update(len(b).to_bytes(4, "little") + b)
    return h.hexdigest()[:20]


def test_without_a_secret_keys_are_todays_chained_hashes():
    ns = Namespace(**FIELDS)
    hashes = chain_page_hashes(np.arange(40), 4)
    assert ns.digest == _todays_digest(ns)
    assert ns.keys(hashes) == [f"hicache:{_todays_digest(ns)}:{h}" for h in hashes]
    assert ns.page_hash_of(ns.key(hashes[3])) == hashes[3]


def test_keyed_names_hide_the_page_hash_and_depend_on_the_secret():
    hashes = chain_page_hashes(np.arange(40), 4)
    plain = Namespace(**FIELDS)
    keyed = Namespace(**FIELDS, seal=Seal(SECRET))
    other = Namespace(**FIELDS, seal=Seal(OTHER))
    keys = keyed.keys(hashes)
    assert len(set(keys)) == len(hashes)
    # Neither the chained hash nor the unkeyed namespace digest appears in any key.
    assert not any(h in k for h in hashes for k in keys)
    assert plain.digest not in keyed.prefix
    assert keyed.digest != other.digest
    assert not set(keys) & set(other.keys(hashes))
    assert not set(keys) & set(plain.keys(hashes))
    # Same secret, same fields: the same names (two instances share a store).
    again = Namespace(**FIELDS, seal=Seal(SECRET))
    assert again == keyed and again.keys(hashes) == keys
    # The tree's hashes themselves are unchanged by the seal.
    assert chain_page_hashes(np.arange(40), 4) == hashes


def test_the_mode_and_every_namespace_field_give_disjoint_names():
    base = Namespace(**FIELDS, seal=Seal(SECRET))
    encrypted = Namespace(**FIELDS, seal=Seal(SECRET, encrypt=True))
    tenant = Namespace(**{**FIELDS, "tenant": "u"}, seal=Seal(SECRET))
    digests = {base.digest, encrypted.digest, tenant.digest}
    assert len(digests) == 3


def test_the_secret_appears_in_no_repr():
    seal = Seal(SECRET, encrypt=True)
    ns = Namespace(**FIELDS, seal=seal)
    for text in (repr(seal), repr(ns), str(ns)):
        assert SECRET.decode() not in text
    assert "seal" not in repr(ns)


def test_short_or_non_bytes_secrets_are_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Seal(b"short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Seal("a-str-secret-of-16+")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seal must be None or a Seal"):
        Namespace(**FIELDS, seal=SECRET)  # type: ignore[arg-type]


def test_hkdf_matches_cryptography_and_rfc5869():
    hkdf_mod = pytest.importorskip("cryptography.hazmat.primitives.kdf.hkdf")
    hashes = pytest.importorskip("cryptography.hazmat.primitives.hashes")
    # RFC 5869, test case 1
    ikm, salt = bytes([0x0B] * 22), bytes(range(13))
    info = bytes(range(0xF0, 0xFA))
    okm = hkdf_sha256(ikm, salt=salt, info=info, length=42)
    assert okm.hex().startswith("3cb25f25faacd57a90434f64d0362f2a")
    ref = hkdf_mod.HKDF(algorithm=hashes.SHA256(), length=42, salt=salt, info=info)
    assert okm == ref.derive(ikm)


def _pieces(data: bytes, n: int = 4) -> list[memoryview]:
    step = len(data) // n
    return [memoryview(bytearray(data[i * step : (i + 1) * step])) for i in range(n)]


@pytest.mark.parametrize("encrypt", [False, True])
def test_seal_and_open_round_trip_and_refuse_tampering(encrypt):
    seal = Seal(SECRET, encrypt=encrypt)
    vkey = seal.value_key("d" * 20) if encrypt else None
    page = bytes(np.random.default_rng(1).integers(0, 256, 256, dtype=np.uint8))
    block, *stored = seal.seal("k1", _pieces(page), vkey)
    if encrypt:
        assert b"".join(bytes(p) for p in stored) != page
    out = [memoryview(bytearray(64)) for _ in range(4)]
    seal.open("k1", block, stored, out, vkey)
    assert b"".join(bytes(p) for p in (out if encrypt else stored)) == page
    with pytest.raises(SealError) as raised:  # another key: the tag binds the key
        seal.open("k2", block, stored, out, vkey)
    assert raised.value.reason == "tag"
    flipped = bytearray(bytes(stored[0]))
    flipped[0] ^= 1
    with pytest.raises(SealError):  # one bit of the payload
        seal.open("k1", block, [bytes(flipped), *stored[1:]], out, vkey)
    other = Seal(OTHER, encrypt=encrypt)
    with pytest.raises(SealError):  # another secret
        other.open("k1", block, stored, out, other.value_key("d" * 20) if encrypt else None)
    with pytest.raises(SealError) as raised:  # the other mode's block
        Seal(SECRET, encrypt=not encrypt).open("k1", block, stored, out, seal.value_key("d" * 20))
    assert raised.value.reason == "seal"


def test_encryption_uses_a_fresh_nonce_per_value():
    seal = Seal(SECRET, encrypt=True)
    vkey = seal.value_key("d" * 20)
    page = bytes(256)
    a = seal.seal("k", _pieces(page), vkey)
    b = seal.seal("k", _pieces(page), vkey)
    assert a[0] != b[0] and a[1] != b[1]
