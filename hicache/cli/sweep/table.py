"""`hicache sweep`'s table: one CSV row per point, written and read back."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from hicache.cli.sweep.grid import Point

__all__ = ["CSV_FIELDS", "HYBRID_FIELDS", "csv_row", "read_csv", "write_csv"]

CSV_FIELDS = (
    "device_tokens",
    "host_tokens",
    "storage",
    "write_policy",
    "eviction",
    "exclusive",
    "page_size",
    "requests",
    "input_tokens",
    "hit_rate",
    "device_hit_rate",
    "host_hit_rate",
    "storage_hit_rate",
    "bound_hit_rate",
    "device_hit_tokens",
    "host_hit_tokens",
    "storage_hit_tokens",
    "device_evicted_tokens",
    "host_evicted_tokens",
    "rejected_requests",
    "storage_cap_bytes",
    "store_policy",
    "storage_evicted_pages",
    "storage_refused_pages",
    "seconds",
)
HYBRID_FIELDS = (
    "hybrid",
    "kv",
    "snapshots_kept",
    "snapshot_hits",
    "snapshot_probes",
    "cut_tokens",
    "verified_pages",
    "corrupt_pages",
    "verified_states",
    "corrupt_states",
)
"""Columns after CSV_FIELDS with --hybrid."""


def csv_row(
    point: Point,
    *,
    write_policy: str,
    eviction: str,
    exclusive: bool,
    page_size: int,
    requests: int,
    input_tokens: int,
    hits: tuple[int, int, int],
    bound: float,
    evictions: tuple[int, int],
    rejected: int,
    seconds: float,
    store: tuple[int | None, str, dict[str, int] | None] = (None, "", None),
) -> dict[str, Any]:
    """One CSV row: a point's configuration and its hits (L1, L2, L3 tokens) per tier.
    `store`: L3's cap in framed bytes (None: unbounded), its policy and what it did
    (evictions, refused; None: not known)."""
    cap, policy, l3 = store
    tokens = input_tokens or 1
    device, host, storage = hits
    return {
        "device_tokens": point.device_tokens,
        "host_tokens": point.host_tokens,
        "storage": point.storage_label,
        "write_policy": write_policy,
        "eviction": eviction,
        "exclusive": exclusive,
        "page_size": page_size,
        "requests": requests,
        "input_tokens": input_tokens,
        "hit_rate": (device + host + storage) / tokens,
        "device_hit_rate": device / tokens,
        "host_hit_rate": host / tokens,
        "storage_hit_rate": storage / tokens,
        "bound_hit_rate": bound,
        "device_hit_tokens": device,
        "host_hit_tokens": host,
        "storage_hit_tokens": storage,
        "device_evicted_tokens": evictions[0],
        "host_evicted_tokens": evictions[1],
        "rejected_requests": rejected,
        "storage_cap_bytes": cap or 0,  # 0: unbounded (or no L3)
        "store_policy": policy if point.capped else "",
        "storage_evicted_pages": (l3 or {}).get("evictions", 0),
        "storage_refused_pages": (l3 or {}).get("refused", 0),
        "seconds": round(seconds, 3),
    }


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else CSV_FIELDS)
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in row.items()})


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Rows of a sweep CSV with numbers parsed back."""
    out: list[dict[str, Any]] = []
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            parsed: dict[str, Any] = {}
            for k, v in row.items():
                if k in ("storage", "write_policy", "eviction", "hybrid", "kv", "store_policy"):
                    parsed[k] = v
                elif k == "exclusive":
                    parsed[k] = v == "True"
                elif k.endswith("_rate") or k == "seconds":
                    parsed[k] = float(v)
                else:
                    parsed[k] = int(v)
            out.append(parsed)
    return out
