"""`hicache replay`'s flags as what the replay runs with: the cache's configuration, where a
temporary file store goes, and the tiers `--pin-first-block` names."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hicache.config import CacheConfig

__all__ = ["cache_config", "pin_tiers", "scratch_dir", "whole_pages"]


def scratch_dir() -> str | None:
    """Where the default file store goes without `--tmp-dir`: RAM-backed /dev/shm when
    writable (a file store on local NVMe behaves like it; an overlay /tmp can cost
    milliseconds per file), else the system's temporary directory. In RAM, the store's
    default cap (90 % of the free space) is most of the machine's memory: `exit.py`
    removes it at every exit."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


# The option that caps each kind of store, by the spec's scheme. Other stores size
# themselves: Redis/Valkey by the server's maxmemory (and its eviction policy), Mooncake by
# its segments, NIXL, AIBrix and 3FS by what their engine or filesystem holds.
_CAP_OPTION = {"file": "max_bytes", "memory": "capacity_bytes"}


def _storage_options(args: argparse.Namespace) -> dict[str, object]:
    """Backend options from the flags: the store's cap, for the stores that have one."""
    cap = getattr(args, "storage_max_bytes", None)
    if cap is None:
        return {}
    from hicache.backends.mooncake.spec import parse_size

    scheme = str(args.storage).split(":", 1)[0]
    option = _CAP_OPTION.get(scheme)
    if option is None:
        raise ValueError(
            f"--storage-max-bytes caps a file or memory store, not {scheme!r}: Redis/Valkey "
            "are capped by the server's maxmemory, Mooncake by its segments, NIXL, AIBrix "
            "and 3FS by their own engine or filesystem (docs/backends.md)"
        )
    return {option: parse_size(cap, "--storage-max-bytes")}


def cache_config(args: argparse.Namespace, *, kv: str, tmp: str) -> CacheConfig:
    """The replay's `CacheConfig`: `kv` for the pool (`--hybrid` replaces `--kv`'s layer
    count), `--storage file` as a store under the temporary directory `tmp`."""
    storage = args.storage
    if storage == "file":
        storage = f"file:{tmp}/store"
    return CacheConfig(
        kv=kv,
        page_size=args.page_size,
        device_tokens=whole_pages("--device-tokens", args.device_tokens, args.page_size),
        host_tokens=whole_pages("--host-tokens", args.host_tokens, args.page_size),
        eviction=args.eviction,
        write_policy=args.write_policy,
        exclusive=args.exclusive,
        storage=None if storage == "none" else storage,
        extra=_storage_options(args),
        model_id=args.model_id,
        metrics_port=getattr(args, "metrics_port", None),
        prefetch_policy=args.prefetch_policy,
        deterministic=args.deterministic,
        seed=args.seed,
        layout=args.layout,
        io_backend=args.io,
        secret_env=getattr(args, "secret_env", None),
        secret_file=getattr(args, "secret_file", None),
        encrypt_at_rest=getattr(args, "encrypt_at_rest", False),
        **({"cpu_transfers": args.cpu_transfers} if args.cpu_transfers else {}),
    )


def whole_pages(flag: str, tokens: int, page_size: int) -> int:
    """A tier size from the command line rounded down to whole pages, as `hicache sweep`
    rounds its sizes (the API, `CacheConfig`, takes exact multiples only); ValueError when
    not even one page is left."""
    rounded = int(tokens) // page_size * page_size
    if rounded <= 0:
        raise ValueError(
            f"{flag} {tokens}: needs at least one page ({page_size} tokens with --page-size "
            f"{page_size})"
        )
    return rounded


def pin_tiers(value: str | None) -> tuple[str, ...]:
    """`--pin-first-block device,host` as the tiers to pin in (empty: no pins)."""
    tiers = tuple(t.strip() for t in (value or "").split(",") if t.strip())
    bad = [t for t in tiers if t not in ("device", "host")]
    if bad or (value is not None and not tiers):
        raise ValueError(f"--pin-first-block: tiers must be device and/or host, got {value!r}")
    return tiers
