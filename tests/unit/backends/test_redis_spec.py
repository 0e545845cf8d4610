"""Parsing of Redis/Valkey specs: every form, every option, and clear errors for bad ones."""

from __future__ import annotations

import pytest

from hicache.backends.redis.spec import DEFAULT_POOL, DEFAULT_TIMEOUT_S, parse_redis_spec


def test_plain_tcp_defaults():
    spec = parse_redis_spec("redis://cache.local")
    assert spec.scheme == "redis" and not spec.tls and not spec.cluster
    assert spec.endpoints == (("cache.local", 6379),)
    assert (spec.db, spec.username, spec.password, spec.path) == (0, None, None, None)
    assert (spec.pool, spec.timeout_s, spec.connect_timeout_s) == (
        DEFAULT_POOL,
        DEFAULT_TIMEOUT_S,
        DEFAULT_TIMEOUT_S,
    )
    assert spec.ttl_s is None and spec.refresh_ttl


def test_credentials_port_db_and_query_options():
    spec = parse_redis_spec(
        "redis://alice:p%40ss%3Aword@10.0.0.5:7000/3?ttl=3600&pool=32&timeout=0.5"
        "&connect_timeout=1.5&pipeline_bytes=65536&refresh_ttl=no"
    )
    assert spec.endpoints == (("10.0.0.5", 7000),)
    assert (spec.username, spec.password, spec.db) == ("alice", "p@ss:word", 3)
    assert (spec.ttl_s, spec.pool, spec.timeout_s, spec.connect_timeout_s) == (3600.0, 32, 0.5, 1.5)
    assert spec.pipeline_bytes == 65536 and not spec.refresh_ttl


def test_password_only_and_keyword_options_override_the_spec():
    spec = parse_redis_spec("redis://:secret@h:1/2?pool=4", {"pool": 8, "db": 5, "username": "bob"})
    assert (spec.username, spec.password, spec.pool, spec.db) == ("bob", "secret", 8, 5)
    assert parse_redis_spec("redis://h", {"password": "x"}).password == "x"


def test_ipv6_host():
    assert parse_redis_spec("redis://[::1]:6380").endpoints == (("::1", 6380),)
    assert parse_redis_spec("redis://[::1]").endpoints == (("::1", 6379),)


def test_tls_options():
    spec = parse_redis_spec(
        "rediss://h:6380?ca=/etc/ca.pem&cert=/c.pem&key=/k.pem&check_hostname=0"
    )
    assert spec.tls and spec.tls_verify and not spec.tls_check_hostname
    assert (spec.tls_ca, spec.tls_cert, spec.tls_key) == ("/etc/ca.pem", "/c.pem", "/k.pem")
    assert not parse_redis_spec("rediss://h", {"verify": False}).tls_verify


def test_unix_socket():
    spec = parse_redis_spec("unix:///run/redis/redis.sock?db=2")
    assert spec.path == "/run/redis/redis.sock" and spec.endpoints == () and spec.db == 2
    with_user = parse_redis_spec("unix://u:pw@/tmp/r.sock")
    assert (with_user.path, with_user.username, with_user.password) == ("/tmp/r.sock", "u", "pw")


def test_cluster_endpoints():
    spec = parse_redis_spec("redis+cluster://a:7000,b:7001,[::1]:7002")
    assert spec.cluster and not spec.tls
    assert spec.endpoints == (("a", 7000), ("b", 7001), ("::1", 7002))
    assert parse_redis_spec("rediss+cluster://a:7000").tls


def test_ttl_zero_means_no_expiry():
    assert parse_redis_spec("redis://h?ttl=0").ttl_s is None
    assert parse_redis_spec("redis://h", {"ttl": 0.25}).ttl_s == 0.25


def test_redacted_hides_the_password():
    spec = parse_redis_spec("redis://alice:hunter2@h:1/4")
    assert "hunter2" not in spec.redacted() and "alice@h:1/4" in spec.redacted()


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        ("http://h", {}, "scheme must be one of"),
        ("redis:/h", {}, "scheme must be one of"),
        ("redis://", {}, "no host"),
        ("redis://h:0", {}, "option port must be an integer >= 1, got '0'"),
        ("redis://h:70000", {}, "out of range"),
        ("redis://h:port", {}, "option port must be an integer, got 'port'"),
        ("redis://h/x", {}, "option db must be an integer, got 'x'"),
        ("redis://a:1,b:2", {}, "several hosts need redis+cluster"),
        ("redis+cluster://a:1/1", {}, "only db 0"),
        ("unix://relative.sock", {}, "absolute socket path"),
        ("redis://h?bogus=1", {}, "unknown option(s) bogus"),
        ("redis://h", {"pool_size": 3}, "unknown option(s) pool_size"),
        ("redis://h?pool=0", {}, "option pool must be an integer >= 1, got '0'"),
        ("redis://h?timeout=-1", {}, "option timeout must be a number >= 0.001, got '-1'"),
        ("redis://h?timeout=nan", {}, "option timeout must be a number, got 'nan'"),
        ("redis://h?ttl=inf", {}, "option ttl must be a number, got 'inf'"),
        ("redis://h?refresh_ttl=maybe", {}, "option refresh_ttl must be yes or no, got 'maybe'"),
        ("redis://h?ca=/x", {}, "need rediss://"),
        ("rediss://h?cert=/c", {}, "cert and key must be given together"),
        ("redis://[::1:5", {}, "bad address"),
    ],
)
def test_bad_specs_name_the_problem(spec, options, message):
    with pytest.raises(ValueError) as raised:
        parse_redis_spec(spec, options)
    assert message in str(raised.value)
    assert repr(spec) in str(raised.value)
