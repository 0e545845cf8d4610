"""`--hicache-storage-backend-extra-config`: the backend's options, validated (docs/sglang.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SGLANG_KEYS = frozenset(
    {
        # the dynamic loader's own (StorageBackendFactory)
        "backend_name",
        "module_path",
        "class_name",
        # read by SGLang's cache controllers (some are removed before the backend sees them)
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
"""Keys of the extra config that SGLang reads itself; the backend accepts and ignores them."""

OPTION_KEYS = frozenset(
    {
        "storage",
        "storage_options",
        "storage_timeout",
        "model_id",
        "salt",
        "secret",
        "secret_env",
        "secret_file",
        "encrypt_at_rest",
    }
)


@dataclass(frozen=True, slots=True)
class StorageOptions:
    """The backend's part of the extra config, validated. Every key: docs/sglang.md."""

    storage: str  # a hicache storage spec (hicache.backends.registry): file:DIR, redis://..., ...
    storage_options: Mapping[str, Any] = field(default_factory=dict)  # the backend's keywords
    storage_timeout: float = 30.0  # seconds one storage call may take; past it, misses
    model_id: str | None = None  # the namespace's model; None: SGLang's model name
    salt: str = ""  # tenant salt: deployments with different salts never share a page
    secret: str | None = field(default=None, repr=False)  # seal (keyed names, tags) ...
    secret_env: str | None = None  # ... from an environment variable ...
    secret_file: str | None = None  # ... or a file
    encrypt_at_rest: bool = False  # AES-256-GCM per value (needs a secret)


def _fail(message: str) -> ValueError:
    return ValueError(f"hicache SGLang storage: {message} (docs/sglang.md)")


def _optional_str(extra: Mapping[str, Any], name: str) -> str | None:
    value = extra.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise _fail(f"{name} must be a non-empty string, got {value!r}")
    return value


def parse_options(extra: Mapping[str, Any] | None) -> StorageOptions:
    """Validate the extra config. Raises ValueError naming an unknown key or a bad value, so
    a typo fails SGLang's start instead of silently running on defaults."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - OPTION_KEYS - SGLANG_KEYS)
    if unknown:
        raise _fail(f"unknown extra config keys {unknown}; the backend's: {sorted(OPTION_KEYS)}")
    storage = extra.get("storage")
    if not isinstance(storage, str) or not storage:
        raise _fail(f"storage must be a hicache storage spec such as 'file:DIR', got {storage!r}")
    from hicache.backends.registry import resolve

    resolve(storage)  # ValueError for an unknown form, listing the known ones
    storage_options = extra.get("storage_options") or {}
    if not isinstance(storage_options, Mapping):
        raise _fail(f"storage_options must be a JSON object, got {storage_options!r}")
    timeout = extra.get("storage_timeout", 30.0)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise _fail(f"storage_timeout must be a positive number of seconds, got {timeout!r}")
    salt = extra.get("salt", "")
    if not isinstance(salt, str):
        raise _fail(f"salt must be a string, got {salt!r}")
    encrypt = extra.get("encrypt_at_rest", False)
    if not isinstance(encrypt, bool):
        raise _fail(f"encrypt_at_rest must be true or false, got {encrypt!r}")
    return StorageOptions(
        storage=storage,
        storage_options=dict(storage_options),
        storage_timeout=float(timeout),
        model_id=_optional_str(extra, "model_id"),
        salt=salt,
        secret=_optional_str(extra, "secret"),
        secret_env=_optional_str(extra, "secret_env"),
        secret_file=_optional_str(extra, "secret_file"),
        encrypt_at_rest=encrypt,
    )


def load_seal(options: StorageOptions) -> Any:
    """The `Seal` the options configure (None without a secret). ValueError naming the field
    (never the secret) for an unreadable or short secret, or encryption without one."""
    from hicache.seal import MIN_SECRET_BYTES, Seal, crypto_missing
    from hicache.secrets import load_credential

    try:
        secret = load_credential(
            "secret",
            value=options.secret,
            env=options.secret_env,
            file=options.secret_file,
            min_bytes=MIN_SECRET_BYTES,
        )
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if options.encrypt_at_rest and secret is None:
        raise _fail("encrypt_at_rest needs a secret: set secret, secret_env or secret_file")
    if options.encrypt_at_rest and (why := crypto_missing()):
        raise _fail(f"encrypt_at_rest: {why}")
    return None if secret is None else Seal(secret, encrypt=options.encrypt_at_rest)
