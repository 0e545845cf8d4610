"""RedisBackend against a real redis-server: round trips, probes, TTL, namespaces, corrupt
values, authentication, unix sockets and TLS."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis_helpers import Pages, namespace, page_keys

from hicache.backends.base import StorageBackend, enforces_ttl, set_from_ttl
from hicache.backends.framing import encode_header
from hicache.backends.redis import RedisBackend
from hicache.backends.redis.spec import DEFAULT_PIPELINE_BYTES

pytestmark = [pytest.mark.redis, pytest.mark.anyio]


async def _store(backend, pages: Pages, keys: list[str]) -> None:
    assert await backend.set_from(keys, pages.buffers(range(len(keys)))) == len(keys)


@pytest.mark.parametrize(
    ("piece_bytes", "pipeline_bytes"),
    [(256, None), (96 * 1024, None), (96 * 1024, 0), (96 * 1024, 1 << 40)],
    ids=["small-default", "large-default", "one-call-per-page", "one-pipeline"],
)
async def test_round_trip_through_layer_first_pieces(
    server, ns, events, piece_bytes, pipeline_bytes
):
    options = {} if pipeline_bytes is None else {"pipeline_bytes": pipeline_bytes}
    backend = RedisBackend.from_spec(server.url, namespace=ns, emit=events, **options)
    assert isinstance(backend, StorageBackend)
    written = Pages(6, piece_bytes).fill(seed=1)
    keys = page_keys(ns, 6)
    await _store(backend, written, keys)
    read = Pages(8, piece_bytes)
    assert await backend.get_into(keys, read.buffers([2, 3, 4, 5, 6, 7])) == 6
    assert [read.page_bytes(i + 2) for i in range(6)] == [written.page_bytes(i) for i in range(6)]
    assert read.page_bytes(0) == bytes(len(read.page_bytes(0)))  # other pages untouched
    stats = backend.stats()
    page = 4 * piece_bytes
    assert (stats["sets"], stats["set_ok"], stats["gets"], stats["get_hits"]) == (6, 6, 6, 6)
    assert stats["bytes_written"] == stats["bytes_read"] == 6 * page
    assert (stats["corrupt"], stats["errors"]) == (0, 0) and events.seen == []
    await backend.aclose()
    await backend.aclose()  # idempotent
    with pytest.raises(RuntimeError, match="after aclose"):
        await backend.exists(keys)


@pytest.mark.parametrize(
    ("page_bytes", "connections"),
    [(DEFAULT_PIPELINE_BYTES // 8, 1), (DEFAULT_PIPELINE_BYTES, 2)],
    ids=["small-pages-one-pipeline", "large-pages-concurrent"],
)
async def test_pages_below_pipeline_bytes_share_a_round_trip(server, ns, page_bytes, connections):
    # Observed from the server: how many connections the backend needed for one batch each way.
    backend = RedisBackend.from_spec(server.url, namespace=ns)
    pages = Pages(4, page_bytes // 4).fill(seed=2)
    keys = page_keys(ns, 4)
    await _store(backend, pages, keys)
    assert await backend.get_into(keys, Pages(4, page_bytes // 4).buffers(range(4))) == 4
    observer = redis.Redis(port=server.port)
    used = [c for c in observer.client_list() if c["name"] == "hicache"]
    assert len(used) == connections if connections == 1 else len(used) >= connections
    observer.close()
    await backend.aclose()


async def test_exists_and_get_count_the_present_prefix(server, ns, inspect):
    backend = RedisBackend.from_spec(server.url, namespace=ns)
    pages = Pages(5).fill(seed=3)
    keys = page_keys(ns, 5)
    await _store(backend, pages, keys)
    await backend.delete([keys[2], ns.key("0" * 64)])  # an absent key is ignored
    assert inspect.exists(keys[2]) == 0
    assert await backend.exists(keys) == 2
    assert await backend.exists(keys[3:]) == 2
    assert await backend.exists([]) == 0
    assert await backend.get_into(keys, Pages(5).buffers(range(5))) == 2
    assert backend.stats()["probe_hits"] == 4
    assert await backend.ping()
    await backend.aclose()


async def test_ttl_is_set_on_write_and_pushed_back_by_reads(server, ns, inspect):
    keys = page_keys(ns, 2)
    pages = Pages(2).fill(seed=4)
    plain = RedisBackend.from_spec(server.url, namespace=ns)
    await _store(plain, pages, keys)
    assert inspect.pttl(keys[0]) == -1  # no ttl: never expires
    expiring = RedisBackend.from_spec(server.url + "?ttl=100", namespace=ns)
    await _store(expiring, pages, keys)
    assert 90_000 < inspect.pttl(keys[0]) <= 100_000
    inspect.pexpire(keys[0], 5_000)
    assert await expiring.get_into(keys[:1], Pages(1).buffers([0])) == 1
    assert inspect.pttl(keys[0]) > 90_000  # the read refreshed it
    fixed = RedisBackend.from_spec(server.url, namespace=ns, ttl=100, refresh_ttl=False)
    inspect.pexpire(keys[0], 5_000)
    assert await fixed.get_into(keys[:1], Pages(1).buffers([0])) == 1
    assert inspect.pttl(keys[0]) <= 5_000
    # An expired value is a plain miss (expiry forced by the server, not waited for).
    inspect.pexpireat(keys[0], 1)
    assert await fixed.get_into(keys, Pages(2).buffers(range(2))) == 0
    assert fixed.stats()["corrupt"] == 0
    for backend in (plain, expiring, fixed):
        await backend.aclose()


async def test_per_value_ttl_sets_px_and_a_past_ttl_is_a_miss(server, ns, inspect):
    keys = page_keys(ns, 3)
    pages = Pages(3).fill(seed=5)
    backend = RedisBackend.from_spec(server.url + "?ttl=1000", namespace=ns)
    assert enforces_ttl(backend)
    assert await set_from_ttl(backend, keys[:2], pages.buffers(range(2)), ttl=30) == 2
    assert 25_000 < inspect.pttl(keys[0]) <= 30_000  # the value's ttl, not the spec's 1000 s
    assert await backend.set_from(keys[2:], pages.buffers([2])) == 1
    assert 990_000 < inspect.pttl(keys[2]) <= 1_000_000  # no ttl given: the spec's
    # A ttl already past stores nothing and removes the older value: a miss, counted stored.
    assert await set_from_ttl(backend, keys[:1], pages.buffers([0]), ttl=-1) == 1
    assert inspect.exists(keys[0]) == 0
    assert await backend.get_into(keys[:1], Pages(1).buffers([0])) == 0
    assert await backend.exists(keys[1:]) == 2
    with pytest.raises(ValueError, match="ttl"):
        await backend.set_from(keys[:1], pages.buffers([0]), ttl=float("inf"))
    await backend.aclose()


async def test_tenants_and_dtypes_never_share_keys(server, inspect):
    tenant_a, tenant_b = namespace(tenant="a"), namespace(tenant="b")
    fp8 = namespace(tenant="a", kv="mha:2:2:8:float8_e4m3fn")
    a = RedisBackend.from_spec(server.url, namespace=tenant_a)
    b = RedisBackend.from_spec(server.url, namespace=tenant_b)
    c = RedisBackend.from_spec(server.url, namespace=fp8)
    pages = Pages(3).fill(seed=5)
    await _store(a, pages, page_keys(tenant_a, 3))
    await _store(b, Pages(3).fill(seed=6), page_keys(tenant_b, 3))
    assert await b.exists(page_keys(tenant_b, 3)) == 3
    assert await c.exists(page_keys(fp8, 3)) == 0  # same tokens, other dtype
    read = Pages(3)
    assert await b.get_into(page_keys(tenant_b, 3), read.buffers(range(3))) == 3
    assert read.page_bytes(0) != pages.page_bytes(0)
    await a.clear()
    assert await a.exists(page_keys(tenant_a, 3)) == 0
    assert await b.exists(page_keys(tenant_b, 3)) == 3  # clear keeps to its namespace
    assert inspect.dbsize() == 3
    for backend in (a, b, c):
        await backend.aclose()


@dataclass(frozen=True)
class _GlobbyNamespace:
    """A namespace whose prefix holds glob characters (the real one never does)."""

    prefix: str

    def key(self, page_hash: str) -> str:
        return self.prefix + page_hash


async def test_clear_matches_the_prefix_literally(server, inspect):
    star = RedisBackend.from_spec(server.url, namespace=_GlobbyNamespace("n[1]*:"))
    await star.set_from(["n[1]*:a", "n[1]*:b"], [[memoryview(b"x")], [memoryview(b"y")]])
    inspect.set("n1x:a", b"another program's")  # matches the prefix read as a glob
    inspect.set("n[1]*", b"shorter than the prefix")
    await star.clear()
    assert sorted(inspect.keys()) == [b"n1x:a", b"n[1]*"]
    await star.aclose()


def _flip_last_byte(value: bytes) -> bytes:
    return value[:-1] + bytes([value[-1] ^ 0x40])


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda r, key, other: r.set(key, _flip_last_byte(r.get(key))), "checksum"),
        (lambda r, key, other: r.set(key, r.get(key)[:-7]), "truncated"),
        (lambda r, key, other: r.set(key, r.get(other)), "key"),  # another page's value
        (lambda r, key, other: r.set(key, b"plain bytes from another program"), "magic"),
        (lambda r, key, other: (r.delete(key), r.rpush(key, b"x")), "foreign"),  # not a string
        (
            lambda r, key, other: r.set(key, encode_header(key, [b"short"]) + b"short"),
            "length",
        ),  # a value of another page size
    ],
    ids=["checksum", "truncated", "swapped", "foreign-bytes", "wrong-type", "page-size"],
)
async def test_corrupt_value_is_a_miss_an_event_and_deleted(
    server, ns, inspect, events, damage, reason
):
    backend = RedisBackend.from_spec(server.url, namespace=ns, emit=events)
    keys = page_keys(ns, 3)
    await _store(backend, Pages(3).fill(seed=7), keys)
    damage(inspect, keys[1], keys[2])
    assert await backend.get_into(keys, Pages(3).buffers(range(3))) == 1
    assert events.named("storage.corrupt") == [
        {"key": keys[1], "reason": reason, "backend": "redis"}
    ]
    assert inspect.exists(keys[1]) == 0  # deleted
    assert inspect.exists(keys[0], keys[2]) == 2  # the good ones stay
    assert backend.stats()["corrupt"] == 1
    assert "storage.unavailable" not in events.names()
    await backend.aclose()


async def test_bad_arguments_raise_before_any_io(server, ns, inspect):
    backend = RedisBackend.from_spec(server.url, namespace=ns)
    keys = page_keys(ns, 2)
    pages = Pages(2)
    foreign = namespace(tenant="other").key("1" * 64)
    with pytest.raises(ValueError, match="not under this backend's namespace"):
        await backend.set_from([keys[0], foreign], pages.buffers(range(2)))
    with pytest.raises(ValueError, match="2 keys but 1 sources"):
        await backend.set_from(keys, pages.buffers([0]))
    with pytest.raises(ValueError, match="piece 0 is read-only"):
        await backend.get_into(keys[:1], [[memoryview(bytes(256))]])
    with pytest.raises(ValueError, match=r"option pool must be an integer, got .zero."):
        RedisBackend.from_spec(server.url + "?pool=zero", namespace=ns)
    assert inspect.dbsize() == 0
    await backend.aclose()


async def test_password_and_acl_user(server_factory, ns, events):
    server = server_factory(
        "--requirepass", "s3cret", "--user", "alice", "on", ">wonder", "~hicache:*", "+@all"
    )
    keys = page_keys(ns, 2)
    pages = Pages(2).fill(seed=8)
    by_spec = RedisBackend.from_spec(f"redis://:s3cret@127.0.0.1:{server.port}", namespace=ns)
    await _store(by_spec, pages, keys)
    by_option = RedisBackend.from_spec(server.url, namespace=ns, password="s3cret")
    assert await by_option.exists(keys) == 2
    alice = RedisBackend.from_spec(f"redis://alice:wonder@127.0.0.1:{server.port}/0", namespace=ns)
    assert await alice.get_into(keys, Pages(2).buffers(range(2))) == 2
    wrong = RedisBackend.from_spec(
        f"redis://alice:guess@127.0.0.1:{server.port}", namespace=ns, emit=events
    )
    assert await wrong.exists(keys) == 0
    assert await wrong.set_from(keys, pages.buffers(range(2))) == 0
    (unavailable,) = events.named("storage.unavailable")  # once, not per call
    assert "AuthenticationError" in unavailable["error"] and "guess" not in str(unavailable)
    anonymous = RedisBackend.from_spec(server.url, namespace=ns)
    assert await anonymous.exists(keys) == 0
    for backend in (by_spec, by_option, alice, wrong, anonymous):
        await backend.aclose()


async def test_unix_socket_and_database_number(server_factory, ns):
    server = server_factory(unix_socket=True)
    backend = RedisBackend.from_spec(f"unix://{server.socket_path}?db=3", namespace=ns)
    pages = Pages(2).fill(seed=9)
    keys = page_keys(ns, 2)
    await _store(backend, pages, keys)
    read = Pages(2)
    assert await backend.get_into(keys, read.buffers(range(2))) == 2
    assert read.page_bytes(1) == pages.page_bytes(1)
    db3 = redis.Redis(unix_socket_path=server.socket_path, db=3)
    db0 = redis.Redis(unix_socket_path=server.socket_path, db=0)
    assert (db3.dbsize(), db0.dbsize()) == (2, 0)
    db3.close()
    db0.close()
    await backend.aclose()


def _make_certs(directory: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, via the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    names = {
        n: str(directory / f"{n}.pem")
        for n in ("ca", "ca-key", "server", "server-key", "client", "client-key")
    }

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
        "-keyout", names["ca-key"], "-out", names["ca"])  # fmt: skip
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for who in ("server", "client"):
        csr = str(directory / f"{who}.csr")
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}",
            "-keyout", names[f"{who}-key"], "-out", csr)  # fmt: skip
        run("x509", "-req", "-in", csr, "-CA", names["ca"], "-CAkey", names["ca-key"],
            "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", names[who])  # fmt: skip
    return names


async def test_tls_with_client_certificate(server_factory, ns, tmp_path, events):
    certs = _make_certs(tmp_path)
    from hicache.testing.redis_server import free_port

    tls_port = free_port()
    server_factory(
        "--tls-port", str(tls_port), "--tls-cert-file", certs["server"],
        "--tls-key-file", certs["server-key"], "--tls-ca-cert-file", certs["ca"],
        "--tls-auth-clients", "yes",
    )  # fmt: skip
    spec = f"rediss://127.0.0.1:{tls_port}?ca={certs['ca']}"
    backend = RedisBackend.from_spec(
        spec, namespace=ns, cert=certs["client"], key=certs["client-key"]
    )
    pages = Pages(2).fill(seed=10)
    keys = page_keys(ns, 2)
    await _store(backend, pages, keys)
    read = Pages(2)
    assert await backend.get_into(keys, read.buffers(range(2))) == 2
    assert read.page_bytes(0) == pages.page_bytes(0)
    no_client_cert = RedisBackend.from_spec(spec, namespace=ns, emit=events, timeout=5)
    assert await no_client_cert.exists(keys) == 0
    assert len(events.named("storage.unavailable")) == 1
    await backend.aclose()
    await no_client_cert.aclose()


async def test_open_backend_resolves_redis_specs(server, ns):
    registry = pytest.importorskip("hicache.backends.registry")
    backend = registry.open_backend(server.url + "?pool=2", namespace=ns)
    assert isinstance(backend, RedisBackend) and backend.spec.pool == 2
    await backend.aclose()
