"""`kv_connector_extra_config`: the connector's options, validated (docs/vllm.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_HOST_FRACTION = 0.10
"""Default L2 size: this fraction of the machine's physical memory, per worker."""

PREFETCH_POLICIES = ("wait_complete", "timeout", "best_effort")
"""How long a request waits for its pages from L3 (hicache's prefetch policies, docs/vllm.md)."""

WRITE_POLICIES = ("write_through", "write_back")
"""When computed pages go to L2 (and on to L3): every step, or when vLLM frees the request."""

# ---------------------------------------------------------------------------------- options


@dataclass(frozen=True, slots=True)
class ConnectorOptions:
    """`kv_connector_extra_config`, validated. Every key is documented in docs/vllm.md."""

    host_bytes: int | None = None  # L2 bytes per worker; None: host_fraction of physical memory
    host_fraction: float = DEFAULT_HOST_FRACTION
    storage: str | None = None  # an L3 spec (hicache.backends.registry), None: no L3
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    storage_timeout: float = 5.0  # seconds per L3 call; past it the call is a miss
    storage_write: bool = True  # write-through of stored pages to L3
    model_id: str | None = None  # the L3 namespace's model; None: vLLM's model name
    salt_requests: bool = True  # a request's cache_salt separates its pages
    prefetch_policy: str = "wait_complete"  # PREFETCH_POLICIES
    prefetch_timeout_base: float = 1.0  # "timeout": seconds per load, plus
    prefetch_timeout_per_ki_token: float = 0.25  # seconds per 1024 tokens loaded
    write_policy: str = "write_through"  # WRITE_POLICIES
    layerwise_loads: bool = False  # L2 -> L1 copies layer by layer, overlapping the forward

    def prefetch_deadline(self, tokens: int) -> float:
        """Seconds an asynchronous load of `tokens` tokens may take before the pages that
        have not landed are recomputed ("timeout"); the other policies wait for the reads
        themselves, each bounded by `storage_timeout`."""
        if self.prefetch_policy == "timeout":
            return self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * tokens / 1024
        return self.storage_timeout


_OPTION_KEYS = {
    "host_bytes",
    "host_gib",
    "host_fraction",
    "storage",
    "storage_options",
    "storage_timeout",
    "storage_write",
    "model_id",
    "salt_requests",
    "prefetch_policy",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "write_policy",
    "layerwise_loads",
}


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"HiCacheConnector: {name} must be one of {list(choices)}, got {value!r}")
    return str(value)


def _seconds(name: str, value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"HiCacheConnector: {name} must be a number, got {value!r}") from None
    if not seconds >= 0:
        raise ValueError(f"HiCacheConnector: {name} must be >= 0, got {value!r}")
    return seconds


def parse_options(extra: Mapping[str, Any] | None) -> ConnectorOptions:
    """Validate `kv_connector_extra_config`. Raises ValueError naming an unknown key or a bad
    value, so a typo fails vLLM's start instead of silently running on defaults."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _OPTION_KEYS)
    if unknown:
        raise ValueError(
            f"HiCacheConnector: unknown kv_connector_extra_config keys {unknown}; "
            f"known: {sorted(_OPTION_KEYS)} (docs/vllm.md)"
        )
    if "host_bytes" in extra and "host_gib" in extra:
        raise ValueError("HiCacheConnector: give host_bytes or host_gib, not both")
    host_bytes: int | None = None
    if "host_bytes" in extra:
        host_bytes = int(extra["host_bytes"])
    elif "host_gib" in extra:
        host_bytes = int(float(extra["host_gib"]) * (1 << 30))
    if host_bytes is not None and host_bytes <= 0:
        raise ValueError(f"HiCacheConnector: host_bytes must be positive, got {host_bytes}")
    fraction = float(extra.get("host_fraction", DEFAULT_HOST_FRACTION))
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"HiCacheConnector: host_fraction must be in (0, 1), got {fraction}")
    storage = extra.get("storage") or None
    if storage is not None and not isinstance(storage, str):
        raise ValueError(f"HiCacheConnector: storage must be a spec string, got {storage!r}")
    if storage is not None:
        from hicache.backends.registry import resolve

        resolve(storage)  # ValueError for an unknown form
    storage_options = extra.get("storage_options") or {}
    if not isinstance(storage_options, Mapping):
        raise ValueError("HiCacheConnector: storage_options must be a mapping")
    timeout = float(extra.get("storage_timeout", 5.0))
    if not timeout > 0:
        raise ValueError(f"HiCacheConnector: storage_timeout must be positive, got {timeout}")
    model_id = extra.get("model_id")
    if model_id is not None and (not isinstance(model_id, str) or not model_id.strip()):
        raise ValueError(f"HiCacheConnector: model_id must be a non-empty string, got {model_id!r}")
    return ConnectorOptions(
        host_bytes=host_bytes,
        host_fraction=fraction,
        storage=storage,
        storage_options=dict(storage_options),
        storage_timeout=timeout,
        storage_write=bool(extra.get("storage_write", True)),
        model_id=model_id,
        salt_requests=bool(extra.get("salt_requests", True)),
        prefetch_policy=_choice(
            "prefetch_policy", extra.get("prefetch_policy", "wait_complete"), PREFETCH_POLICIES
        ),
        prefetch_timeout_base=_seconds(
            "prefetch_timeout_base", extra.get("prefetch_timeout_base", 1.0)
        ),
        prefetch_timeout_per_ki_token=_seconds(
            "prefetch_timeout_per_ki_token", extra.get("prefetch_timeout_per_ki_token", 0.25)
        ),
        write_policy=_choice(
            "write_policy", extra.get("write_policy", "write_through"), WRITE_POLICIES
        ),
        layerwise_loads=bool(extra.get("layerwise_loads", False)),
    )


def default_host_bytes(fraction: float, tp_size: int) -> int:
    """`fraction` of physical memory, shared by the `tp_size` workers of one machine."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        physical = 16 << 30
    return int(physical * fraction) // max(1, tp_size)
