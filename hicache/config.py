"""Frozen configuration of one cache instance, its validation and its rewrites.

`CacheConfig` is what an engine author writes; `CacheConfig.resolve()` returns the config that
will actually run plus the rewrites applied (each becomes a `config.rewritten` warning event),
or raises `ConfigError` naming the field where no rewrite is sound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, TypeGuard

# The names come from the registries that implement them (all four modules are torch-free).
from hicache.kernels.names import DEFAULT_TRANSFER_SMS, IO_BACKENDS, LAYOUTS, MAX_TRANSFER_SMS
from hicache.policies.eviction import STRATEGIES
from hicache.policies.prefetch import PREFETCH_POLICIES
from hicache.policies.write import WRITE_POLICIES as _WRITE_POLICIES
from hicache.seal import MIN_SECRET_BYTES, Seal, crypto_missing
from hicache.secrets import load_credential, redact_text, redact_url, safe_repr

EVICTION_POLICIES: tuple[str, ...] = tuple(STRATEGIES)
WRITE_POLICIES: tuple[str, ...] = tuple(_WRITE_POLICIES)
_REAL_IO_SCHEMES = (
    "redis://",
    "rediss://",
    "unix://",
    "redis+cluster://",
    "rediss+cluster://",
    "mooncake://",
)
_DEFAULT_MODEL_ID = "model"  # with storage on, must be replaced by the model's own name


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field and the accepted values."""


@dataclass(frozen=True, slots=True)
class Rewrite:
    field: str
    old: object
    new: object
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    # geometry of the KV bytes: "mha:LAYERS:HEADS:HEAD_DIM:DTYPE" or "mla:LAYERS:RANK:ROPE:DTYPE"
    kv: str = "mha:4:2:64:float16"
    page_size: int = 64
    device_tokens: int = 65_536
    host_tokens: int | None = None  # default: 2 x device_tokens (the seed's hicache_ratio)
    # The allocator prepares (faults in, pins with CUDA) the host pool in chunks of about this
    # many bytes (whole pages, at least one) and leases each to the tree once ready: the cache
    # serves from the first chunk on. 0: the whole pool before open returns.
    host_chunk_bytes: int = 256 << 20
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    layout: Literal["layer_first", "page_first", "page_first_direct", "page_head"] = "page_first"
    # Without CUDA: loads copied on the event loop at submit and backups on one compiled copy
    # thread beside it ("inline": every layer has landed when the load is answered, no Python
    # thread hand-offs) or on a worker thread per direction
    # ("thread": overlaps compute running in other threads; on 2 cores the hand-offs cost more
    # than they buy, see docs/benchmarks.md "Control plane").
    cpu_transfers: Literal["thread", "inline"] = "inline"
    io_backend: Literal["kernel", "direct"] = "kernel"
    # CUDA: the SMs kernel io's copy kernel may occupy (the rest stay the model's).
    transfer_sms: int = DEFAULT_TRANSFER_SMS

    eviction: str = "lru"
    write_policy: str = "write_through_selective"
    # exclusive L2: a victim tier that takes what L1 drops and gives up its copy on load-back
    exclusive: bool = False
    load_back_threshold: int = 10  # tokens; smaller L2 hits are not worth a transfer
    # Retention (docs/api.md, "Retention and pins"): priorities 0-100; pages outside every
    # range have this one. Eviction takes the lowest priority first, then the strategy's order.
    default_priority: int = 35
    # Tokens that pins may hold per tier (None: half the tier); `pin` past it raises
    # PinLimitError, so pinned pages never leave too little room to run requests.
    max_pinned_device_tokens: int | None = None
    max_pinned_host_tokens: int | None = None

    storage: str | None = None  # None | "memory" | "file:DIR" | "redis://..." | "module:Class"
    model_id: str = _DEFAULT_MODEL_ID  # must be set when storage is on (part of every L3 key)
    tenant: str = ""
    # L3 protection (docs/security.md): a secret (>= 16 bytes) keys the page names and tags
    # every value; give it one way: inline, a file or an environment variable. Never shown.
    secret: bytes | str | None = field(default=None, repr=False)
    secret_file: str | None = None
    secret_env: str | None = None
    encrypt_at_rest: bool = False  # AES-256-GCM per value; needs a secret and `cryptography`
    # With L3: a page leaving L1 without an L2 copy is first copied to L2, and so reaches L3,
    # whatever the write policy (False: dropped, as without L3). docs/configuration.md.
    evict_to_storage: bool = True
    prefetch_policy: str = "timeout"
    prefetch_threshold: int = 256  # tokens; clamped up to page_size
    prefetch_timeout_base: float = 1.0  # seconds
    prefetch_timeout_per_ki_token: float = 0.25  # seconds per 1024 tokens
    prefetch_rate_fraction: float = 0.8  # in-flight prefetch tokens <= this x (host - device)
    storage_batch_pages: int = 128
    upload_retries: int = 3
    upload_backoff: float = 0.05  # seconds, doubled per retry
    # Every backend call (probe, read, upload, clear) ends within this many seconds of the
    # actor system's clock; a call past it is a miss or a failed upload, with an event.
    storage_timeout: float = 30.0
    # Close waits this long for in-flight work (uploads, prefetches) before abandoning it.
    close_timeout: float = 60.0
    # Nodes waiting for an upload credit; past it, uploads are skipped (event + counter).
    max_upload_backlog: int = 1024

    tp_rank: int = 0
    tp_size: int = 1

    channel_capacity: int = 256  # every mailbox; credits are derived from it
    deterministic: bool = False
    seed: int = 0
    transfer_bandwidth: float = 20e9  # bytes/s, virtual streams only (deterministic mode)
    # Serve Prometheus metrics on this port (/metrics; 0: any free port); needs the `metrics`
    # extra (prometheus_client). docs/metrics.md.
    metrics_port: int | None = None
    # Publish KV events in vLLM's wire format (ZMQ PUB; binds "tcp://*:5557"-style wildcards and
    # ipc/inproc, connects to anything else, as vLLM does); needs the `kv-events` extra.
    # docs/kv-events.md.
    kv_events: str | None = None
    kv_events_replay: str | None = None  # ROUTER endpoint answering replays (always binds)
    kv_events_topic: str = ""  # first frame of every message
    kv_events_buffer: int = 10_000  # batches kept for replay
    # events as vLLM sends them since vllm-project/vllm#42892 ("map"), or positional
    kv_events_format: Literal["map", "array"] = "map"

    extra: dict[str, object] = field(default_factory=dict)  # backend options

    def __repr__(self) -> str:  # the storage spec and backend options may hold passwords
        return safe_repr(self)

    def load_secret(self) -> bytes | None:
        """The secret from `secret`, `secret_file` or `secret_env` (None: none configured).
        Reads the file or the environment; raises ConfigError naming the field, not the value."""
        try:
            return load_credential(
                "secret",
                value=self.secret,
                env=self.secret_env,
                file=self.secret_file,
                min_bytes=MIN_SECRET_BYTES,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def storage_seal(self) -> Seal | None:
        """The `Seal` for this instance's L3 namespace (keys.Namespace(seal=...)), or None
        without a secret. Raises ConfigError as `load_secret` and `resolve` do."""
        secret = self.load_secret()
        _check_encryption(self.encrypt_at_rest, secret is not None)
        return None if secret is None else Seal(secret, encrypt=self.encrypt_at_rest)

    @property
    def host_capacity(self) -> int:
        return self.host_tokens if self.host_tokens is not None else 2 * self.device_tokens

    def pin_cap(self, tier: str) -> int:
        """Tokens pins may hold in "device" or "host"."""
        if tier == "device":
            cap, size = self.max_pinned_device_tokens, self.device_tokens
        else:
            cap, size = self.max_pinned_host_tokens, self.host_capacity
        return size // 2 if cap is None else cap

    @property
    def effective_prefetch_threshold(self) -> int:
        return max(self.prefetch_threshold, self.page_size)

    def prefetch_timeout(self, num_tokens: int) -> float:
        """The `timeout` policy's deadline for a prefetch of `num_tokens` (whole pages)."""
        return self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * num_tokens / 1024

    def resolve(self) -> tuple[CacheConfig, tuple[Rewrite, ...]]:
        """Validate, then rewrite unsupported combinations. Raises ConfigError. Pure but for
        reading `secret_file` / `secret_env` where set (so a missing secret fails here)."""
        _check_choice("eviction", self.eviction, EVICTION_POLICIES)
        _check_choice("write_policy", self.write_policy, WRITE_POLICIES)
        _check_choice("prefetch_policy", self.prefetch_policy, PREFETCH_POLICIES)
        _check_choice("layout", self.layout, LAYOUTS)
        _check_choice("io_backend", self.io_backend, IO_BACKENDS)
        _check_choice("cpu_transfers", self.cpu_transfers, ("thread", "inline"))
        _check_positive("page_size", self.page_size)
        if not (_is_int(self.transfer_sms) and 1 <= self.transfer_sms <= MAX_TRANSFER_SMS):
            raise ConfigError(
                f"transfer_sms={self.transfer_sms!r} must be an integer in [1, {MAX_TRANSFER_SMS}]: "
                "the SMs kernel io's copy kernel may occupy on CUDA"
            )
        _check_positive("device_tokens", self.device_tokens)
        _check_int("host_chunk_bytes", self.host_chunk_bytes, minimum=0)
        if self.host_tokens is not None:
            _check_positive("host_tokens", self.host_tokens)
        _check_positive("channel_capacity", self.channel_capacity)
        _check_positive("storage_batch_pages", self.storage_batch_pages)
        _check_int("load_back_threshold", self.load_back_threshold, minimum=0)
        _check_int("default_priority", self.default_priority, minimum=0)
        if self.default_priority > 100:
            raise ConfigError(f"default_priority={self.default_priority!r} must be in [0, 100]")
        for name in ("max_pinned_device_tokens", "max_pinned_host_tokens"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
        _check_int("prefetch_threshold", self.prefetch_threshold, minimum=0)
        _check_int("upload_retries", self.upload_retries, minimum=0)
        _check_int("max_upload_backlog", self.max_upload_backlog, minimum=0)
        _check_int("seed", self.seed)
        if self.metrics_port is not None and not (
            _is_int(self.metrics_port) and 0 <= self.metrics_port <= 65535
        ):
            raise ConfigError(
                f"metrics_port={self.metrics_port!r} must be None or a port in [0, 65535]"
            )
        _check_kv_events(self)
        _check_int("tp_size", self.tp_size, minimum=1)
        _check_int("tp_rank", self.tp_rank, minimum=0)
        _check_seconds("upload_backoff", self.upload_backoff, zero_ok=True)
        _check_seconds("prefetch_timeout_base", self.prefetch_timeout_base, zero_ok=True)
        _check_seconds(
            "prefetch_timeout_per_ki_token", self.prefetch_timeout_per_ki_token, zero_ok=True
        )
        _check_seconds("storage_timeout", self.storage_timeout, zero_ok=False)
        _check_seconds("close_timeout", self.close_timeout, zero_ok=False)
        if not _is_number(self.transfer_bandwidth) or not self.transfer_bandwidth > 0:  # NaN too
            raise ConfigError(
                f"transfer_bandwidth={self.transfer_bandwidth!r} must be a number of bytes/s > 0"
            )
        if not _is_number(self.prefetch_rate_fraction) or not 0 < self.prefetch_rate_fraction <= 1:
            raise ConfigError(
                f"prefetch_rate_fraction={self.prefetch_rate_fraction!r} must be in (0, 1]"
            )
        if not isinstance(self.extra, dict):
            raise ConfigError(
                f"extra={redact_text(repr(self.extra))} must be a dict of backend options"
            )
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            raise ConfigError(f"model_id={self.model_id!r} must be a non-empty string")
        if not isinstance(self.tenant, str):
            raise ConfigError(f"tenant={self.tenant!r} must be a string")
        _check_encryption(self.encrypt_at_rest, self.load_secret() is not None)
        if not isinstance(self.evict_to_storage, bool):
            raise ConfigError(f"evict_to_storage={self.evict_to_storage!r} must be True or False")
        if self.storage is not None and not isinstance(self.storage, str):
            raise ConfigError(
                f"storage={redact_text(repr(self.storage))} must be None or a backend spec string"
            )
        if self.storage and self.model_id == _DEFAULT_MODEL_ID:
            raise ConfigError(
                f"storage={redact_url(self.storage)!r} needs model_id: set model_id to name the model "
                f"(it is part of every L3 key; with the default model_id={_DEFAULT_MODEL_ID!r} "
                "two models of the same geometry would share L3 keys and read each other's KV)"
            )
        if self.deterministic and self.storage and self.storage.startswith(_REAL_IO_SCHEMES):
            raise ConfigError(
                f"storage={redact_url(self.storage)!r} with deterministic=True: a virtual-time "
                "cache runs no real I/O; use storage 'memory' or 'file:DIR' (or a backend of "
                "your own that runs inline), or deterministic=False"
            )
        if self.channel_capacity < 4:
            raise ConfigError("channel_capacity must be at least 4 (credits need room)")
        if self.device_tokens % self.page_size:
            raise ConfigError(
                f"device_tokens={self.device_tokens} is not a multiple of page_size={self.page_size}"
            )
        host = self.host_capacity
        if host % self.page_size:
            raise ConfigError(f"host_tokens={host} is not a multiple of page_size={self.page_size}")
        if host <= self.device_tokens:
            raise ConfigError(
                f"host_tokens={host} must be larger than device_tokens={self.device_tokens}"
            )
        if not self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank={self.tp_rank} is outside [0, tp_size={self.tp_size})")

        rewrites: list[Rewrite] = []
        cfg = self
        if cfg.io_backend == "direct" and cfg.layout == "page_first":
            rewrites.append(
                Rewrite(
                    "layout",
                    "page_first",
                    "page_first_direct",
                    "direct io copies whole per-layer page runs; page_first has none",
                )
            )
            cfg = replace(cfg, layout="page_first_direct")
        if cfg.kv.startswith("mla") and cfg.layout == "page_head":
            raise ConfigError(
                "layout='page_head' splits by head and needs MHA; MLA has one latent head"
            )
        if cfg.exclusive and cfg.write_policy != "write_back":
            rewrites.append(
                Rewrite(
                    "write_policy",
                    cfg.write_policy,
                    "write_back",
                    "an exclusive L2 only takes what L1 drops",
                )
            )
            cfg = replace(cfg, write_policy="write_back")
        return cfg, tuple(rewrites)


def _check_encryption(encrypt: object, has_secret: bool) -> None:
    if not isinstance(encrypt, bool):
        raise ConfigError(f"encrypt_at_rest={encrypt!r} must be True or False")
    if encrypt and not has_secret:
        raise ConfigError(
            "encrypt_at_rest=True needs a secret: set secret, secret_file or secret_env"
        )
    if encrypt and (why := crypto_missing()):
        raise ConfigError(f"encrypt_at_rest=True: {why}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int in Python


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_positive(name: str, value: int) -> None:
    if not _is_int(value) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer")


def _check_int(name: str, value: object, minimum: int | None = None) -> None:
    if not _is_int(value):
        raise ConfigError(f"{name}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")


_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _check_kv_events(cfg: CacheConfig) -> None:
    for name in ("kv_events", "kv_events_replay"):
        value = getattr(cfg, name)
        if value is not None and (
            not isinstance(value, str)
            or not value.startswith(_ZMQ_SCHEMES)
            or len(value) <= value.index("://") + 3
        ):
            raise ConfigError(
                f"{name}={value!r} must be None or a ZMQ endpoint "
                "(tcp://HOST:PORT, ipc://PATH or inproc://NAME)"
            )
    if cfg.kv_events_replay is not None and cfg.kv_events is None:
        raise ConfigError(
            "kv_events_replay is set but kv_events is not: replays answer for a publisher"
        )
    if (
        cfg.kv_events_replay is not None
        and cfg.kv_events_replay == cfg.kv_events
        and not cfg.kv_events.endswith(":*")
    ):  # "...:*" binds any free port, each its own
        raise ConfigError(
            f"kv_events_replay={cfg.kv_events_replay!r} is kv_events' endpoint: "
            "the replay socket needs its own"
        )
    if not isinstance(cfg.kv_events_topic, str):
        raise ConfigError(f"kv_events_topic={cfg.kv_events_topic!r} must be a string")
    _check_positive("kv_events_buffer", cfg.kv_events_buffer)
    _check_choice("kv_events_format", cfg.kv_events_format, ("map", "array"))


def _check_seconds(name: str, value: object, *, zero_ok: bool) -> None:
    """A finite duration in seconds: >= 0 (`zero_ok`) or > 0. NaN fails every comparison."""
    ok = _is_number(value) and math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
    if not ok:
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{name}={value!r} must be a finite number of seconds {bound}")
