"""Parsing of `mooncake://` storage specs into a validated, immutable settings value.

    mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata&protocol=tcp
        &segment=0&local_buffer=16MiB&staging=64MiB&lanes=4&batch=128&host=ADDR
        &device=NAME&probe_timeout=5&retry=1

Every query value is optional; options passed as keywords to `from_spec` override the query.
Pure: no I/O beyond resolving which local address routes to the master (`local_address`).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from hicache.backends.spec_options import integer, number
from hicache.secrets import redact_url, safe_repr

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 10**3,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"\s*(\d+)\s*([a-zA-Z]*)\s*")
PROTOCOLS = ("tcp", "rdma")
HTTP_METADATA_PORT = 8080  # mooncake_master's default --http_metadata_server_port


def parse_size(value: object, what: str) -> int:
    """Bytes from an int or a string like "64MiB" / "4GB" / "1048576". Raises ValueError."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE_RE.fullmatch(str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{what} must be a byte size like 64MiB or 1048576, got {value!r}")
        n = int(m.group(1)) * _UNITS[unit]
    if n < 0:
        raise ValueError(f"{what} must not be negative, got {value!r}")
    return n


@dataclass(frozen=True, slots=True, kw_only=True)
class MooncakeSpec:
    """Validated settings of one Mooncake Store client. Immutable."""

    master_host: str
    master_port: int
    metadata: str  # metadata server URL ("http://…/metadata"), or "P2PHANDSHAKE"
    protocol: str  # "tcp" or "rdma"
    device: str  # RDMA device names for protocol=rdma; "" for tcp
    host: str  # this client's address as peers see it; "" = the one routing to the master
    segment: int  # bytes this client contributes to the store (0: a pure client)
    local_buffer: int  # the Mooncake client's own transfer buffer
    staging: int  # registered bytes for pages outside registered host memory, all lanes
    lanes: int  # concurrent client calls; each owns a header area and 1/lanes of staging
    batch: int  # most keys in one client call
    probe_timeout: float  # seconds after which an `exists` probe counts as a miss
    retry: float  # seconds to answer misses without trying after the master was unreachable

    def __repr__(self) -> str:  # the metadata URL may carry a password
        return safe_repr(self)

    @property
    def master(self) -> str:
        return f"{self.master_host}:{self.master_port}"

    def local_address(self) -> str:
        """`host`, or the local address whose route reaches the master (no packet is sent)."""
        if self.host:
            return self.host
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((self.master_host, self.master_port))
                address: str = s.getsockname()[0]
                return address
            except OSError:
                return "127.0.0.1"


_OPTION_NAMES = (
    "metadata",
    "protocol",
    "device",
    "host",
    "segment",
    "local_buffer",
    "staging",
    "lanes",
    "batch",
    "probe_timeout",
    "retry",
)


def parse_spec(spec: str, options: Mapping[str, object] | None = None) -> MooncakeSpec:
    """Validate `spec` (and keyword `options`, which win over the query). Raises ValueError
    naming the offending part (the spec's credentials, if any, shown as ***); never touches
    the network."""
    if not isinstance(spec, str) or not spec.startswith("mooncake://"):
        raise ValueError(f"a Mooncake spec starts with mooncake://, got {redact_url(str(spec))!r}")
    parts = urlsplit(spec)
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise ValueError(
            f"Mooncake spec {redact_url(spec)!r}: bad master address ({exc})"
        ) from None
    if not host or port is None:
        raise ValueError(
            f"Mooncake spec {redact_url(spec)!r} must name the master as mooncake://HOST:PORT"
        )
    if parts.path not in ("", "/") or parts.fragment:
        raise ValueError(
            f"Mooncake spec {redact_url(spec)!r}: unexpected path or fragment after HOST:PORT"
        )
    query = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False))
    merged: dict[str, object] = {**query, **dict(options or {})}
    unknown = sorted(set(merged) - set(_OPTION_NAMES))
    if unknown:
        raise ValueError(
            f"Mooncake spec: unknown option(s) {unknown}; known: {list(_OPTION_NAMES)}"
        )
    protocol = str(merged.get("protocol", "tcp"))
    if protocol not in PROTOCOLS:
        raise ValueError(f"Mooncake spec: protocol must be one of {PROTOCOLS}, got {protocol!r}")
    device = str(merged.get("device", ""))
    if protocol == "rdma" and not device:
        raise ValueError("Mooncake spec: protocol=rdma needs device=NAME (e.g. mlx5_0)")
    metadata = str(merged.get("metadata", f"http://{host}:{HTTP_METADATA_PORT}/metadata"))
    if metadata != "P2PHANDSHAKE" and not re.match(r"(https?|etcd|redis)://", metadata):
        raise ValueError(
            f"Mooncake spec: metadata must be a http://, etcd:// or redis:// URL "
            f"or P2PHANDSHAKE, got {redact_url(metadata)!r}"
        )
    lanes = integer(merged.get("lanes", 4), "Mooncake option lanes", lo=1)
    staging = parse_size(merged.get("staging", "64MiB"), "staging")
    if staging < lanes:
        raise ValueError(
            f"Mooncake spec: staging of {staging} bytes cannot be split into {lanes} lanes"
        )
    return MooncakeSpec(
        master_host=host,
        master_port=port,
        metadata=metadata,
        protocol=protocol,
        device=device,
        host=str(merged.get("host", "")),
        segment=parse_size(merged.get("segment", 0), "segment"),
        local_buffer=parse_size(merged.get("local_buffer", "16MiB"), "local_buffer"),
        staging=staging,
        lanes=lanes,
        batch=integer(merged.get("batch", 128), "Mooncake option batch", lo=1),
        probe_timeout=number(
            merged.get("probe_timeout", 5), "Mooncake option probe_timeout", lo=0, open_lo=True
        ),
        retry=number(merged.get("retry", 1), "Mooncake option retry", lo=0, open_lo=True),
    )
