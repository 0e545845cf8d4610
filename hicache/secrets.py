"""Secrets and credentials: where they come from, and how they stay out of every output.

A secret (the store's HMAC/encryption secret, a Redis password) may be given inline, in a file
or in an environment variable. `load_credential` reads exactly one of them and names the
offending field in its error, never the value. `redact_url` / `redact_text` / `redact_options`
replace passwords in spec strings, messages and option dicts before they reach an exception, a
repr, an event or a JSON summary (docs/security.md). Pure standard library; no hicache imports.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***"

_SECRET_NAMES = frozenset({"password", "passwd", "secret", "token", "auth", "credentials"})
_SECRET_SUFFIXES = ("_password", "_passwd", "_secret")
# userinfo runs to the last "@" that no "://" separates from the scheme (a password may hold
# "/" or "?"; a URL nested in a query option is its own match)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>(?:(?!://)[^\s'\"])*@)")
_QUERY_SECRET = re.compile(
    r"(?i)(?P<name>[?&](?:password|passwd|pass|secret|token|auth)=)(?P<value>[^&#\s'\"]*)"
)


def is_secret_name(name: str) -> bool:
    """Whether an option called `name` holds a secret (password, secret, token, ...). Names
    that only point at one (`password_env`, `secret_file`) are not secrets."""
    lowered = name.lower()
    return lowered in _SECRET_NAMES or lowered.endswith(_SECRET_SUFFIXES)


def redact_url(spec: str) -> str:
    """`spec` with the password of every `scheme://user:password@` and every password-like
    query value replaced by ***. The user name stays (it says which account)."""

    def userinfo(m: re.Match[str]) -> str:
        user, colon, _password = m.group("userinfo")[:-1].partition(":")
        return f"{m.group('scheme')}{user}{':' + REDACTED if colon else ''}@"

    text = _USERINFO.sub(userinfo, spec)
    return _QUERY_SECRET.sub(lambda m: m.group("name") + REDACTED, text)


def redact_text(text: str, *secrets: str | bytes | None) -> str:
    """`redact_url` over free text, and every given secret's literal occurrences removed."""
    out = redact_url(text)
    for secret in secrets:
        text_secret = secret.decode(errors="replace") if isinstance(secret, bytes) else secret
        if text_secret:
            out = out.replace(text_secret, REDACTED)
    return out


def redact_options(options: Mapping[str, object]) -> dict[str, object]:
    """A copy of backend options for display: secret-named values hidden, strings redacted."""
    out: dict[str, object] = {}
    for name, value in options.items():
        if is_secret_name(str(name)) and value is not None:
            out[name] = REDACTED
        elif isinstance(value, str):
            out[name] = redact_url(value)
        else:
            out[name] = value
    return out


def safe_fields(obj: Any) -> dict[str, Any]:
    """A dataclass's fields for display: fields declared `repr=False` and secret-named ones
    shown as *** (None stays None), spec strings and option dicts redacted."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is not None and (not f.repr or is_secret_name(f.name)):
            value = REDACTED
        elif isinstance(value, str):
            value = redact_url(value)
        elif isinstance(value, Mapping):
            value = redact_options(value)
        out[f.name] = value
    return out


def safe_repr(obj: Any) -> str:
    """`Class(field=value, ...)` over `safe_fields`: a repr that cannot show a secret."""
    shown = ", ".join(f"{name}={value!r}" for name, value in safe_fields(obj).items())
    return f"{type(obj).__name__}({shown})"


def load_credential(
    field: str,
    *,
    value: str | bytes | None = None,
    env: str | None = None,
    file: str | None = None,
    min_bytes: int = 1,
) -> bytes | None:
    """The credential named `field` from at most one source: `value` itself, the environment
    variable `env` or the file `file` (one trailing newline dropped). None when no source is
    given. Raises ValueError naming `field`, `field_env` or `field_file`, never the value."""
    given = [
        name
        for name, src in ((field, value), (f"{field}_env", env), (f"{field}_file", file))
        if src is not None
    ]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} are both set: give the {field} one way only")
    if value is not None:
        if not isinstance(value, (str, bytes)):
            raise ValueError(f"{field} must be str or bytes, got {type(value).__name__}")
        raw = value.encode() if isinstance(value, str) else bytes(value)
        where = field
    elif env is not None:
        if not isinstance(env, str) or not env:
            raise ValueError(f"{field}_env={env!r} must name an environment variable")
        text = os.environ.get(env)
        if not text:
            raise ValueError(f"{field}_env={env!r}: the environment variable is unset or empty")
        raw, where = text.encode(), f"{field}_env={env!r}"
    elif file is not None:
        if not isinstance(file, (str, os.PathLike)) or not str(file):
            raise ValueError(f"{field}_file={file!r} must be a path")
        try:
            with open(file, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise ValueError(
                f"{field}_file={str(file)!r} cannot be read ({type(exc).__name__}: {exc.strerror})"
            ) from None
        raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw
        where = f"{field}_file={str(file)!r}"
    else:
        return None
    if len(raw) < min_bytes:
        raise ValueError(f"{where}: the {field} must be at least {min_bytes} bytes, got {len(raw)}")
    return raw
