"""Secrets and credentials: each source of the L3 secret and of a Redis password is validated
with an error naming the field, and a planted secret never shows in an exception, a repr or
an event, whichever way it was given."""

from __future__ import annotations

import json

import pytest

from hicache import seal as seal_module
from hicache.backends.keys import Namespace
from hicache.backends.mooncake.spec import parse_spec as parse_mooncake_spec
from hicache.backends.redis.spec import parse_redis_spec
from hicache.backends.registry import open_backend
from hicache.config import CacheConfig, ConfigError
from hicache.observability.events import plain
from hicache.secrets import redact_url

PLANT = "Plant3d-S3cr3t-Valu3-9f8e7d"
SLASHED = "Pl4nt/with?sl4sh#and@at"  # the characters that break naive URL parsing
ENV = "HICACHE_TEST_PLANTED_SECRET"
NS = Namespace(model="m", kv="mha:2:2:4:bfloat16", page_size=4)


def assert_clean(*texts: object) -> None:
    for text in texts:
        shown = text if isinstance(text, str) else repr(text)
        for secret in (PLANT, SLASHED, *SLASHED.split("/"), "with?sl4sh"):
            assert secret not in shown, f"{secret!r} leaked into {shown!r}"


def raised_message(fn, *args, **kwargs) -> str:
    with pytest.raises(Exception) as raised:  # any error: only its text matters
        fn(*args, **kwargs)
    return f"{raised.value}|{raised.value!r}|{raised.value.__cause__!r}"


# -- the L3 secret: sources and validation -----------------------------------------------------


def test_each_source_gives_the_same_seal(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_text(PLANT + "\n")  # one trailing newline is not part of the secret
    monkeypatch.setenv(ENV, PLANT)
    seals = [
        CacheConfig(secret=PLANT).storage_seal(),
        CacheConfig(secret=PLANT.encode()).storage_seal(),
        CacheConfig(secret_file=str(path)).storage_seal(),
        CacheConfig(secret_env=ENV).storage_seal(),
    ]
    assert seals[0] is not None and all(s == seals[0] for s in seals)
    assert CacheConfig().storage_seal() is None
    assert CacheConfig(secret=PLANT, encrypt_at_rest=True).storage_seal() != seals[0]


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(secret="short"), "secret"),
        (dict(secret=12345678901234567), "secret"),
        (dict(secret=PLANT, secret_env=ENV), "secret and secret_env"),
        (dict(secret_env=ENV), "secret_env="),
        (dict(secret_env=""), "secret_env="),
        (dict(secret_file="/nonexistent/hicache-secret"), "secret_file="),
        (dict(encrypt_at_rest=True), "encrypt_at_rest=True needs a secret"),
        (dict(encrypt_at_rest="yes", secret=PLANT), "encrypt_at_rest='yes'"),
    ],
)
def test_bad_secret_configs_name_the_field(fields, named, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ConfigError) as raised:
        CacheConfig(**fields).resolve()
    assert named in str(raised.value)
    assert_clean(str(raised.value))


def test_encryption_without_cryptography_is_a_clear_config_error(monkeypatch):
    monkeypatch.setattr(seal_module, "crypto_missing", lambda: "it needs `cryptography`")
    monkeypatch.setattr("hicache.config.crypto_missing", seal_module.crypto_missing)
    with pytest.raises(ConfigError, match="encrypt_at_rest=True: it needs `cryptography`"):
        CacheConfig(secret=PLANT, encrypt_at_rest=True).resolve()


# -- Redis passwords: sources and validation ---------------------------------------------------


def test_redis_password_from_env_or_file(tmp_path, monkeypatch):
    path = tmp_path / "pw"
    path.write_text(PLANT + "\n")
    monkeypatch.setenv(ENV, PLANT)
    from_file = parse_redis_spec(f"redis://h:1?password_file={path}")
    from_env = parse_redis_spec("redis://h:1", {"password_env": ENV})
    assert from_file.password == from_env.password == PLANT
    assert_clean(repr(from_file), repr(from_env), from_file.redacted())
    for spec, options in [
        (f"redis://:{PLANT}@h:1?password_env={ENV}", {}),
        ("redis://h:1", {"password_env": ENV, "password_file": str(path)}),
        ("redis://h:1", {"password_env": "HICACHE_UNSET_VARIABLE"}),
    ]:
        message = raised_message(parse_redis_spec, spec, options)
        assert "password" in message
        assert_clean(message)


# -- every channel, every path: the planted secret is never shown ------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        f"redis://user:{PLANT}@h:notaport/0",
        f"redis://:{PLANT}@h:1/x",
        f"redis://:{PLANT}@h:1?bogus=1",
        f"redis://:{PLANT}@h:1?password={PLANT}&pool=-1",
        f"redis://:{SLASHED}@h:1/0?pool=0",
        f"redis://:{SLASHED}@",
        f"rediss://:{PLANT}@h:1?verify=maybe",
        f"unix://u:{PLANT}@relative.sock",
        f"redis://h:1?password={PLANT}&ttl=-5",
    ],
)
def test_spec_errors_never_show_the_password(spec):
    assert_clean(raised_message(parse_redis_spec, spec))
    assert_clean(raised_message(open_backend, spec, namespace=NS))


def test_reprs_and_events_never_show_the_secret(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_text(PLANT)
    monkeypatch.setenv(ENV, PLANT)
    spec = f"redis://alice:{PLANT}@h:1/0"
    configs = [
        CacheConfig(secret=PLANT, model_id="m", storage="memory"),
        CacheConfig(secret=PLANT.encode(), encrypt_at_rest=True),
        CacheConfig(secret_file=str(path)),
        CacheConfig(secret_env=ENV),
        CacheConfig(storage=spec, model_id="m", extra={"password": PLANT, "db": 0}),
        CacheConfig(storage=f"redis://:{SLASHED}@h:1", model_id="m"),
    ]
    for cfg in configs:
        seal = cfg.storage_seal()
        assert_clean(repr(cfg), str(cfg), json.dumps(plain(cfg), default=repr), repr(seal))
        if seal is not None:
            ns = Namespace(model="m", kv=cfg.kv, page_size=cfg.page_size, seal=seal)
            assert_clean(repr(ns), json.dumps(plain(ns), default=repr))
    # a resolve error that shows the storage spec (the default model_id)
    assert_clean(raised_message(CacheConfig(storage=spec).resolve))
    assert "alice" in raised_message(CacheConfig(storage=spec).resolve)  # the user stays
    redis_spec = parse_redis_spec(spec)
    assert_clean(repr(redis_spec), json.dumps(plain(redis_spec), default=repr))
    mooncake = f"mooncake://m:50051?metadata=redis://:{PLANT}@m:6379/0"
    assert_clean(repr(parse_mooncake_spec(mooncake)))
    assert_clean(raised_message(parse_mooncake_spec, mooncake + "&protocol=carrier-pigeon"))
    assert_clean(raised_message(parse_mooncake_spec, f"mooncake://m:1?metadata=ftp://:{PLANT}@x"))
    assert_clean(redact_url(f"{spec}?password={PLANT}"))


async def test_unverified_tls_warns_and_no_event_shows_the_password():
    pytest.importorskip("redis")
    from hicache.backends.redis import RedisBackend

    seen: list[tuple[str, dict]] = []
    backend = RedisBackend.from_spec(
        f"rediss://alice:{PLANT}@127.0.0.1:1/0?verify=no&connect_timeout=0.5&lazy_connect=yes",
        namespace=NS,
        emit=lambda event, **fields: seen.append((event, fields)),
    )
    assert [e for e, _ in seen] == ["storage.tls_unverified"]
    assert seen[0][1]["server"] == "rediss://alice@127.0.0.1:1/0"
    assert await backend.exists([NS.key("0" * 64)]) == 0  # nothing listens on port 1
    assert "storage.unavailable" in [e for e, _ in seen]
    assert_clean(repr(seen), repr(backend.spec), repr(backend.stats()))
    await backend.aclose()
    quiet: list[str] = []
    RedisBackend.from_spec("rediss://h:1", namespace=NS, emit=lambda e, **f: quiet.append(e))
    assert quiet == []  # verified TLS: no warning


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


pytestmark = pytest.mark.anyio
