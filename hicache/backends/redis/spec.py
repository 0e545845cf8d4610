"""Parsing of Redis/Valkey storage specs into a validated, immutable `RedisSpec`.

Accepted forms (query options and keyword options are the same names; keyword options win):

    redis://[user[:password]@]host[:port][/db][?opt=value&...]
    rediss://...                       same, over TLS (ca, cert, key, verify, check_hostname)
    unix:///path/to/redis.sock[?db=N&...]
    redis+cluster://host:port[,host:port...][?...]     Redis Cluster (db must be 0)
    rediss+cluster://...               Redis Cluster over TLS

The password may also come from `password_env=NAME` (an environment variable) or
`password_file=PATH` (one trailing newline dropped), so it need not appear in any spec string.
Pure but for reading those: no client objects. Every error is a ValueError naming the spec,
with its password replaced by *** (the password itself never appears), and what was wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

from hicache.backends import spec_options
from hicache.secrets import load_credential, redact_text, redact_url

DEFAULT_PORT = 6379
DEFAULT_POOL = 16
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_PIPELINE_BYTES = (
    4 * 1024 * 1024
)  # best or near it for 16 KiB..4 MiB pages (bench/storage_redis.py)
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisSpec:
    """Where and how to connect; built only by `parse_redis_spec`, so every field is valid."""

    scheme: str  # one of SCHEMES
    endpoints: tuple[tuple[str, int], ...]  # (host, port); empty for unix
    path: str | None  # unix socket path
    db: int
    username: str | None
    password: str | None = field(repr=False)  # never in a repr, message or event
    ttl_s: float | None  # expiry of written values; None: never expire
    refresh_ttl: bool  # reads push expiry back (GETEX), so pages in use stay
    pool: int  # max connections (per node in a cluster); also the in-flight call limit
    timeout_s: float  # socket read/write timeout and pool wait
    connect_timeout_s: float
    pipeline_bytes: int  # most page bytes in one pipelined call; a larger page goes alone
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    tls_verify: bool
    tls_check_hostname: bool
    lazy_connect: bool = (
        False  # open without checking the server (misses + events until it answers)
    )

    @property
    def tls(self) -> bool:
        return self.scheme in ("rediss", "rediss+cluster")

    @property
    def cluster(self) -> bool:
        return self.scheme.endswith("+cluster")

    def redacted(self) -> str:
        """The spec without credentials, for logs and events."""
        where = self.path or ",".join(f"{h}:{p}" for h, p in self.endpoints)
        user = f"{self.username}@" if self.username else ""
        return f"{self.scheme}://{user}{where}/{self.db}"


def _what(spec: str, name: str) -> str:
    return f"{spec!r}: option {name}"


def _integer(spec: str, name: str, raw: Any, lo: int) -> int:
    return spec_options.integer(raw, _what(spec, name), lo=lo)


def _seconds(spec: str, name: str, raw: Any) -> float:
    return spec_options.number(raw, _what(spec, name), lo=0.001)


# redis-py's words for certificate checks ("required", "none") read as yes and no too
_YES = spec_options.YES | {"required"}
_NO = (spec_options.NO - {""}) | {"none"}  # an empty value never turns a check off


def _flag(spec: str, name: str, raw: Any) -> bool:
    return spec_options.flag(raw, _what(spec, name), yes=_YES, no=_NO)


def _endpoint(spec: str, text: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{spec!r}: bad address {text!r}")
        port_text = rest[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"{spec!r}: address {text!r} has no host")
    port = DEFAULT_PORT if not port_text else _integer(spec, "port", port_text, 1)
    if port > 65535:
        raise ValueError(f"{spec!r}: port {port} is out of range")
    return host, port


_OPTION_NAMES = frozenset(
    {
        "db", "username", "password", "ttl", "refresh_ttl", "pool", "timeout",
        "connect_timeout", "pipeline_bytes", "ca", "cert", "key", "verify", "check_hostname",
        "lazy_connect", "password_env", "password_file",
    }
)  # fmt: skip


def parse_redis_spec(spec: str, options: Mapping[str, Any] | None = None) -> RedisSpec:
    """Validate `spec` plus keyword `options` (which override query options) into a RedisSpec."""
    shown = redact_url(spec)
    try:
        return _parse(shown, spec, options)
    except ValueError as exc:  # belt and braces: no part of a password in any message
        userinfo = spec.partition("?")[0].rpartition("@")[0]
        pass_text = userinfo.partition(":")[2]
        given = (options or {}).get("password")
        hidden = [p for p in (pass_text, unquote(pass_text), given) if isinstance(p, str)]
        raise ValueError(redact_text(str(exc), *hidden)) from None


def _parse(shown: str, spec: str, options: Mapping[str, Any] | None) -> RedisSpec:
    # Errors name `shown` (the spec, password redacted) as "spec"; `spec` is only parsed.
    scheme, sep, rest = spec.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(
            f"{shown!r}: scheme must be one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    rest, _, query = rest.partition("?")
    opts: dict[str, Any] = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=False))
    opts.update(options or {})
    unknown = sorted(set(opts) - _OPTION_NAMES)
    if unknown:
        raise ValueError(f"{shown!r}: unknown option(s) {', '.join(unknown)}")

    username = password = None
    endpoints: tuple[tuple[str, int], ...] = ()
    path: str | None = None
    db = 0
    if scheme == "unix":
        userinfo, at, where = rest.rpartition("@")
        if not at:
            userinfo, where = "", rest
        if not where.startswith("/") or where == "/":
            raise ValueError(f"{shown!r}: unix:// needs an absolute socket path, as unix:///path")
        path = unquote(where)
    else:
        # userinfo first: a password may hold "/" (hosts and db never hold "@")
        userinfo, at, netloc = rest.rpartition("@")
        if not at:
            userinfo, netloc = "", rest
        hosts, _slash, db_text = netloc.partition("/")
        if not hosts:
            raise ValueError(f"{shown!r}: no host given")
        endpoints = tuple(_endpoint(shown, h) for h in hosts.split(","))
        if len(endpoints) > 1 and not scheme.endswith("+cluster"):
            raise ValueError(f"{shown!r}: several hosts need redis+cluster://")
        if db_text:
            db = _integer(shown, "db", db_text, 0)
    if userinfo:
        user_text, colon, pass_text = userinfo.partition(":")
        username = unquote(user_text) or None
        password = unquote(pass_text) if colon else None
    if "db" in opts:
        db = _integer(shown, "db", opts["db"], 0)
    if scheme.endswith("+cluster") and db != 0:
        raise ValueError(f"{shown!r}: Redis Cluster has only db 0, got db {db}")
    username = opts.get("username", username) or None
    password = opts.get("password", password)
    if password == "":
        password = None
    try:
        stored = load_credential(
            "password", env=opts.get("password_env"), file=opts.get("password_file")
        )
    except ValueError as exc:
        raise ValueError(f"{shown!r}: {exc}") from None
    if stored is not None:
        if password is not None:
            raise ValueError(
                f"{shown!r}: a password in the spec or password= and in password_env/"
                "password_file: give it one way"
            )
        password = stored.decode()

    timeout = _seconds(shown, "timeout", opts.get("timeout", DEFAULT_TIMEOUT_S))
    ttl = opts.get("ttl")
    tls_options = {"ca", "cert", "key", "verify", "check_hostname"} & set(opts)
    if tls_options and not scheme.startswith("rediss"):
        raise ValueError(
            f"{shown!r}: TLS option(s) {', '.join(sorted(tls_options))} need rediss://"
        )
    if (opts.get("cert") is None) != (opts.get("key") is None):
        raise ValueError(f"{shown!r}: TLS cert and key must be given together")
    return RedisSpec(
        scheme=scheme,
        endpoints=endpoints,
        path=path,
        db=db,
        username=username,
        password=password,
        ttl_s=None if ttl in (None, "", 0, "0") else _seconds(shown, "ttl", ttl),
        refresh_ttl=_flag(shown, "refresh_ttl", opts.get("refresh_ttl", True)),
        pool=_integer(shown, "pool", opts.get("pool", DEFAULT_POOL), 1),
        timeout_s=timeout,
        connect_timeout_s=_seconds(shown, "connect_timeout", opts.get("connect_timeout", timeout)),
        pipeline_bytes=_integer(
            shown, "pipeline_bytes", opts.get("pipeline_bytes", DEFAULT_PIPELINE_BYTES), 0
        ),
        tls_ca=opts.get("ca") or None,
        tls_cert=opts.get("cert") or None,
        tls_key=opts.get("key") or None,
        tls_verify=_flag(shown, "verify", opts.get("verify", True)),
        tls_check_hostname=_flag(shown, "check_hostname", opts.get("check_hostname", True)),
        lazy_connect=_flag(shown, "lazy_connect", opts.get("lazy_connect", False)),
    )
