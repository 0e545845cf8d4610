"""Spec string -> storage backend, with lazy imports (a backend's dependencies load only
when it is chosen).

Known forms:
    memory                                   hicache.backends.memory:MemoryBackend
    file:DIR                                 hicache.backends.file:FileBackend
    redis://… rediss://… unix://… redis+cluster://…   hicache.backends.redis:RedisBackend
    mooncake://…                             hicache.backends.mooncake:MooncakeBackend
    nixl:DIR[?…]                             hicache.backends.nixl:NixlBackend
    aibrix:DIR[?…]                           hicache.backends.aibrix:AibrixBackend
    hf3fs:DIR[?…]                            hicache.backends.hf3fs:Hf3fsBackend
    package.module:Class[?ARG]               any class with the same from_spec classmethod

Every backend class offers `from_spec(spec, *, namespace, emit=None, **options)`; the full
spec string is passed through unchanged. `open_backend` builds the backend (no I/O for the
shipped ones); `connect_backend` builds it and then awaits its optional `connect()` check
(base.py), which is how the cache opens storage. When the namespace carries a `Seal` (a
secret), the backend comes back wrapped by `sealing.backend.seal_backend`: keyed names come
from the namespace itself, sealed values from the wrapper, whatever the backend.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import anyio

from hicache.backends.base import BackendUnavailable, EventSink, StorageBackend
from hicache.backends.keys import Namespace
from hicache.backends.sealing.backend import seal_backend
from hicache.secrets import redact_url

_SCHEMES: tuple[tuple[str, str], ...] = (
    ("redis://", "hicache.backends.redis:RedisBackend"),
    ("rediss://", "hicache.backends.redis:RedisBackend"),
    ("unix://", "hicache.backends.redis:RedisBackend"),
    ("redis+cluster://", "hicache.backends.redis:RedisBackend"),
    ("rediss+cluster://", "hicache.backends.redis:RedisBackend"),
    ("mooncake://", "hicache.backends.mooncake:MooncakeBackend"),
    ("nixl:", "hicache.backends.nixl:NixlBackend"),
    ("aibrix:", "hicache.backends.aibrix:AibrixBackend"),
    ("hf3fs:", "hicache.backends.hf3fs:Hf3fsBackend"),
)
_IMPORT_PATH = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*)(\?.*)?")

_RESERVED = frozenset(
    {"memory", "file", "redis", "rediss", "unix", "mooncake", "nixl", "aibrix", "hf3fs"}
)  # typos, not modules

KNOWN_FORMS = (
    "memory",
    "file:DIR",
    "redis://HOST:PORT[/DB]",
    "rediss://…",
    "unix:///PATH",
    "redis+cluster://HOST:PORT",
    "rediss+cluster://HOST:PORT",
    "mooncake://…",
    "nixl:DIR",
    "aibrix:DIR",
    "hf3fs:DIR",
    "package.module:Class",
)


def resolve(spec: str) -> str:
    """The `module:Class` that serves `spec`. Raises ValueError listing the known forms."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"storage spec must be a non-empty string; known forms: {', '.join(KNOWN_FORMS)}"
        )
    if spec == "memory":
        return "hicache.backends.memory:MemoryBackend"
    if spec.startswith("file:"):
        if not spec[len("file:") :]:
            raise ValueError("storage spec 'file:' needs a directory, e.g. file:/var/cache/hicache")
        return "hicache.backends.file:FileBackend"
    for scheme, target in _SCHEMES:
        if spec.startswith(scheme):
            return target
    m = _IMPORT_PATH.fullmatch(spec)
    if m and m.group(1) not in _RESERVED:
        return f"{m.group(1)}:{m.group(2)}"
    raise ValueError(
        f"unknown storage spec {redact_url(spec)!r}; known forms: {', '.join(KNOWN_FORMS)}"
    )


def open_backend(
    spec: str,
    *,
    namespace: Namespace,
    emit: EventSink | None = None,
    virtual_time: bool = False,
    **options: Any,
) -> StorageBackend:
    """Build the backend `spec` names for `namespace`. With `virtual_time` (a deterministic
    cache), the class's own `VIRTUAL_TIME_OPTIONS` (e.g. the file store's `threads=0`: no real
    threads on a virtual clock) fill in options not given. Raises ValueError for an unknown or
    malformed spec, ImportError (with the spec) when the backend's module cannot load. Error
    messages show the spec with its password replaced by ***."""
    if not isinstance(namespace, Namespace):
        raise TypeError(
            f"namespace must be a hicache.backends.keys.Namespace, got {type(namespace).__name__}"
        )
    target = resolve(spec)
    shown = redact_url(spec)
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"storage spec {shown!r} needs module {module_name!r}, which failed to import: {exc} (known forms: {', '.join(KNOWN_FORMS)})"
        ) from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"storage spec {shown!r}: module {module_name!r} has no {class_name!r}")
    from_spec = getattr(cls, "from_spec", None)
    if not callable(from_spec):
        raise TypeError(f"storage spec {shown!r}: {target} has no from_spec classmethod")
    if virtual_time:
        options = {**getattr(cls, "VIRTUAL_TIME_OPTIONS", {}), **options}
    backend = from_spec(spec, namespace=namespace, emit=emit, **options)
    if not isinstance(backend, StorageBackend):
        raise TypeError(
            f"storage spec {shown!r}: {target}.from_spec returned {type(backend).__name__}, not a StorageBackend"
        )
    return seal_backend(backend, namespace, emit=emit, virtual_time=virtual_time)


async def connect_backend(
    spec: str,
    *,
    namespace: Namespace,
    emit: EventSink | None = None,
    virtual_time: bool = False,
    connect_timeout: float | None = None,
    **options: Any,
) -> StorageBackend:
    """`open_backend`, then the backend's `connect()` coroutine where it has one (base.py: a
    network store checks there that its server answers and accepts the credentials), bounded
    by `connect_timeout` seconds (None: the caller bounds it). Raises what `open_backend`
    raises, and what `connect` raises (`BackendUnavailable` for an unreachable or refusing
    store, or one that does not answer in time), after closing the backend."""
    backend = open_backend(
        spec, namespace=namespace, emit=emit, virtual_time=virtual_time, **options
    )
    connect = getattr(backend, "connect", None)
    if callable(connect):
        try:
            with anyio.move_on_after(connect_timeout) as waited:
                await connect()
            if waited.cancelled_caught:
                raise BackendUnavailable(
                    f"storage {redact_url(spec)!r} did not answer connect within "
                    f"{connect_timeout} s"
                )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await backend.aclose()
            raise
    return backend
