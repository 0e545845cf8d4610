"""Opening against a real server that refuses this client: wrong password, missing password,
a db it does not have. Each fails the open with BackendUnavailable naming host:port and never
the password; the right credentials open and work."""

from __future__ import annotations

import pytest
from redis_helpers import Pages, page_keys

from hicache import CacheConfig, HiCache
from hicache.backends.base import BackendUnavailable
from hicache.backends.registry import connect_backend

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

PASSWORD = "right-horse-battery"
WRONG = "wrong-staple-77"


@pytest.fixture
def locked(server_factory):
    return server_factory("--requirepass", PASSWORD)


def _address(server) -> str:
    return f"127.0.0.1:{server.port}"


async def test_wrong_password_fails_the_open(locked, ns, events):
    with pytest.raises(BackendUnavailable) as raised:
        await connect_backend(f"redis://:{WRONG}@{_address(locked)}", namespace=ns, emit=events)
    message = str(raised.value)
    assert _address(locked) in message
    assert WRONG not in message and PASSWORD not in message
    assert "AuthenticationError" in message or "WRONGPASS" in message
    assert events.seen == []  # refused at open: an error, not an event


async def test_wrong_password_as_an_option_fails_the_open(locked, ns):
    with pytest.raises(BackendUnavailable) as raised:
        await connect_backend(f"redis://{_address(locked)}", namespace=ns, password=WRONG)
    assert _address(locked) in str(raised.value) and WRONG not in str(raised.value)


async def test_missing_password_fails_the_open(locked, ns):
    with pytest.raises(BackendUnavailable, match=_address(locked)):
        await connect_backend(f"redis://{_address(locked)}", namespace=ns)


async def test_unknown_db_fails_the_open(server, ns):
    with pytest.raises(BackendUnavailable, match=_address(server)):
        await connect_backend(f"redis://{_address(server)}/999", namespace=ns)


async def test_wrong_password_fails_the_cache_open(locked):
    cfg = CacheConfig(
        kv="mha:2:1:8:float32",
        page_size=4,
        device_tokens=64,
        host_tokens=256,
        device="cpu",
        model_id="m",
        storage=f"redis://:{WRONG}@{_address(locked)}",
    )
    with pytest.raises(BackendUnavailable) as raised:
        async with HiCache(cfg):
            pass
    assert WRONG not in str(raised.value)


async def test_right_password_opens_and_stores(locked, ns, events):
    backend = await connect_backend(
        f"redis://:{PASSWORD}@{_address(locked)}", namespace=ns, emit=events
    )
    keys = page_keys(ns, 2)
    pages = Pages(2).fill(seed=9)
    assert await backend.set_from(keys, pages.buffers(range(2))) == 2
    read = Pages(2)
    assert await backend.get_into(keys, read.buffers(range(2))) == 2
    assert read.page_bytes(1) == pages.page_bytes(1)
    assert events.seen == []
    await backend.aclose()


async def test_lazy_connect_opens_with_a_wrong_password(locked, ns, events):
    backend = await connect_backend(
        f"redis://:{WRONG}@{_address(locked)}", namespace=ns, emit=events, lazy_connect=True
    )
    assert await backend.exists(page_keys(ns, 1)) == 0
    (unavailable,) = events.named("storage.unavailable")
    assert WRONG not in repr(unavailable)
    await backend.aclose()
