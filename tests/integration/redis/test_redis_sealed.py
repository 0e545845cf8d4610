"""Redis with a secret: the password from a file, keyed and encrypted values round-trip
through a real server, and a value planted without the secret is a miss and an event."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import redis
from redis_helpers import Events

from hicache.backends.framing import encode_header
from hicache.backends.registry import connect_backend
from hicache.radix.hashes import chain_page_hashes
from hicache.seal import Seal

pytestmark = pytest.mark.anyio
PASSWORD = "Plant3d-Redis-Passw0rd"


@pytest.mark.parametrize("encrypt", [False, True], ids=["tag", "aes-gcm"])
async def test_sealed_values_over_a_password_protected_server(
    server_factory, ns, tmp_path, encrypt
):
    server = server_factory("--requirepass", PASSWORD)
    (tmp_path / "pw").write_text(PASSWORD + "\n")
    sns = dataclasses.replace(ns, seal=Seal(b"redis-test-secret-0123456789", encrypt=encrypt))
    events = Events()
    spec = f"redis://127.0.0.1:{server.port}/0?password_file={tmp_path / 'pw'}"
    backend = await connect_backend(spec, namespace=sns, emit=events)
    keys = sns.keys(chain_page_hashes(np.arange(3 * sns.page_size), sns.page_size))
    rng = np.random.default_rng(5)
    pages = [[memoryview(rng.bytes(256)) for _ in range(4)] for _ in keys]
    assert await backend.set_from(keys, pages) == 3
    out = [[memoryview(bytearray(256)) for _ in range(4)] for _ in keys]
    assert await backend.get_into(keys, out) == 3
    assert [b"".join(map(bytes, p)) for p in out] == [b"".join(map(bytes, p)) for p in pages]
    # someone with the password but not the secret overwrites page 1 with a framed page
    payload = b"".join(map(bytes, pages[1]))

    client = redis.Redis(host="127.0.0.1", port=server.port, password=PASSWORD)
    fake = bytes(52) + payload  # a seal block's room, no valid seal
    client.set(keys[1], encode_header(keys[1], [fake]) + fake)
    client.close()
    assert await backend.get_into(keys, out) == 1
    assert [(f["key"], f["reason"]) for f in events.named("storage.corrupt")] == [(keys[1], "seal")]
    assert PASSWORD not in repr(events.seen) and PASSWORD not in repr(backend.inner.spec)
    await backend.aclose()
