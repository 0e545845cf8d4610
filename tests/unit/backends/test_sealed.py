"""Sealed values (sealed.SealedBackend over the memory and file backends): exact round trips,
a foreign secret is a miss, and a forged, altered or moved value is a miss plus a
`storage.corrupt` event, never an error and never KV."""

from __future__ import annotations

import dataclasses

import pytest

from hicache.backends.framing import decode_header, encode_header
from hicache.backends.registry import connect_backend, open_backend
from hicache.backends.sealing.backend import SealedBackend, seal_backend
from hicache.seal import MODE_TAG, SEAL_MAGIC, SEAL_SIZE, Seal

from .conftest import FakeHostPool, page_keys
from .harness import Events, FileHarness, MemoryHarness

pytestmark = pytest.mark.anyio

SECRET = b"secret-one-is-16-bytes-or-more"
OTHER = b"secret-two-is-16-bytes-or-more"
MODES = pytest.mark.parametrize("encrypt", [False, True], ids=["tag", "aes-gcm"])


@pytest.fixture(params=[MemoryHarness, FileHarness], ids=lambda h: h.kind)
def harness(request, tmp_path):
    return request.param(tmp_path)


def sealed_ns(ns, secret=SECRET, encrypt=False):
    return dataclasses.replace(ns, seal=Seal(secret, encrypt=encrypt))


def open_sealed(harness, ns, events=None):
    return seal_backend(harness.open(ns, emit=events), ns, emit=events, threads=2)


async def write(backend, pool, keys, seed=0):
    for i in range(len(keys)):
        pool.fill(i, seed=seed + i)
    assert await backend.set_from(keys, [pool.page_buffer(i) for i in range(len(keys))]) == len(
        keys
    )


def read_into(out: FakeHostPool, n: int) -> list:
    return [out.page_buffer(i) for i in range(n)]


def reframe(key: str, payload: bytes) -> bytes:
    """What someone with write access to the store can do: a well-framed value of their own."""
    return encode_header(key, [payload]) + payload


def payload_of(key: str, value: bytes) -> bytes:
    return value[decode_header(value, key).size :]


@MODES
async def test_round_trip_is_exact(harness, ns, pool, encrypt):
    sns = sealed_ns(ns, encrypt=encrypt)
    backend = open_sealed(harness, sns)
    assert isinstance(backend, SealedBackend)
    keys = page_keys(sns, 4)
    await write(backend, pool, keys)
    out = FakeHostPool(pages=8)
    assert await backend.exists(keys) == 4
    assert await backend.get_into(keys, read_into(out, 4)) == 4
    assert [out.page_bytes(i) for i in range(4)] == [pool.page_bytes(i) for i in range(4)]
    stats = backend.stats()
    assert (stats["get_hits"], stats["corrupt"], stats["seal_rejected"]) == (4, 0, 0)
    # what the store holds: the page in clear (tag mode) or not at all (encrypted)
    stored: list[bytes] = []
    harness.tamper(keys[0], lambda v: stored.append(v) or v)
    assert len(payload_of(keys[0], stored[0])) == SEAL_SIZE + len(pool.page_bytes(0))
    assert (pool.page_bytes(0) in stored[0]) is not encrypt
    await backend.aclose()


@MODES
async def test_a_value_written_under_another_secret_is_a_miss(harness, ns, pool, encrypt):
    events = Events()
    writer = open_sealed(harness, sealed_ns(ns, SECRET, encrypt))
    reader_ns = sealed_ns(ns, OTHER, encrypt)
    reader = open_sealed(harness, reader_ns, events)
    await write(writer, pool, page_keys(sealed_ns(ns, SECRET, encrypt), 3))
    keys = page_keys(reader_ns, 3)  # the same prompt names other keys under another secret
    out = FakeHostPool(pages=8)
    assert await reader.exists(keys) == 0
    assert await reader.get_into(keys, read_into(out, 3)) == 0
    assert out.page_bytes(0) == bytes(len(pool.page_bytes(0)))


@MODES
async def test_a_value_forged_without_the_secret_is_a_miss_and_corrupt(harness, ns, pool, encrypt):
    events = Events()
    sns = sealed_ns(ns, encrypt=encrypt)
    backend = open_sealed(harness, sns, events)
    keys = page_keys(sns, 3)
    await write(backend, pool, keys)
    page = pool.page_bytes(1)
    # 1: a plain framed page planted at a listed key (right key, no seal block)
    harness.tamper(keys[1], lambda v: reframe(keys[1], page))
    # 2: a seal block of the right shape with a made-up tag, at the next key
    fake = SEAL_MAGIC + bytes([MODE_TAG if not encrypt else 2]) + bytes(3 + 12 + 32)
    harness.tamper(keys[2], lambda v: reframe(keys[2], fake + page))
    out = FakeHostPool(pages=8)
    assert await backend.get_into(keys, read_into(out, 3)) == 1
    assert await backend.get_into(keys[2:], read_into(out, 1)) == 0
    reasons = [(f["key"], f["reason"]) for f in events.named("storage.corrupt")]
    assert reasons == [(keys[1], "length"), (keys[2], "tag")]
    assert not harness.present(keys[1]) and not harness.present(keys[2])
    assert backend.stats()["corrupt"] == 2


@MODES
async def test_an_altered_payload_with_a_fixed_checksum_is_a_miss(harness, ns, pool, encrypt):
    events = Events()
    sns = sealed_ns(ns, encrypt=encrypt)
    backend = open_sealed(harness, sns, events)
    keys = page_keys(sns, 2)
    await write(backend, pool, keys)

    def flip_last_byte(value: bytes) -> bytes:
        body = bytearray(payload_of(keys[0], value))
        body[-1] ^= 0x80
        return reframe(keys[0], bytes(body))  # the CRC is right again; only the tag can tell

    harness.tamper(keys[0], flip_last_byte)
    out = FakeHostPool(pages=8)
    assert await backend.get_into(keys, read_into(out, 2)) == 0
    assert [f["reason"] for f in events.named("storage.corrupt")] == ["tag"]
    assert backend.stats()["get_hits"] == 0


@MODES
async def test_a_valid_value_moved_to_another_key_is_a_miss(harness, ns, pool, encrypt):
    events = Events()
    sns = sealed_ns(ns, encrypt=encrypt)
    backend = open_sealed(harness, sns, events)
    keys = page_keys(sns, 2)
    await write(backend, pool, keys)
    taken: list[bytes] = []
    harness.tamper(keys[0], lambda v: taken.append(payload_of(keys[0], v)) or v)
    harness.tamper(keys[1], lambda v: reframe(keys[1], taken[0]))
    out = FakeHostPool(pages=8)
    assert await backend.get_into(keys[1:], read_into(out, 1)) == 0
    assert [f["reason"] for f in events.named("storage.corrupt")] == ["tag"]


async def test_an_encrypted_value_under_the_wrong_key_is_a_miss(harness, ns, pool):
    events = Events()
    a_ns, b_ns = sealed_ns(ns, SECRET, True), sealed_ns(ns, OTHER, True)
    a = open_sealed(harness, a_ns)
    b = open_sealed(harness, b_ns, events)
    a_keys, b_keys = page_keys(a_ns, 1), page_keys(b_ns, 1)
    await write(a, pool, a_keys)
    await write(b, pool, b_keys, seed=99)
    taken: list[bytes] = []
    harness.tamper(a_keys[0], lambda v: taken.append(payload_of(a_keys[0], v)) or v)
    harness.tamper(b_keys[0], lambda v: reframe(b_keys[0], taken[0]))  # A's ciphertext at B's key
    out = FakeHostPool(pages=8)
    assert await b.get_into(b_keys, read_into(out, 1)) == 0
    assert [f["reason"] for f in events.named("storage.corrupt")] == ["tag"]


async def test_registry_seals_what_it_opens_and_only_with_a_seal(tmp_path, ns):
    plain = open_backend("memory", namespace=ns)
    assert not isinstance(plain, SealedBackend)
    sns = sealed_ns(ns)
    sealed = await connect_backend(f"file:{tmp_path}", namespace=sns, virtual_time=True)
    assert isinstance(sealed, SealedBackend)
    assert sealed._runner.inline  # virtual time: no real threads
    assert seal_backend(sealed, sns) is sealed  # never sealed twice
    await sealed.aclose()
