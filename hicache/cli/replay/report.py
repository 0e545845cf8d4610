"""`hicache replay`'s report: the summary `--json` writes and the table it prints."""

from __future__ import annotations

from typing import Any

from hicache.cli.tally import Tally
from hicache.cli.trace import TraceRequest, bound_hit_rate
from hicache.config import CacheConfig
from hicache.secrets import redact_url

__all__ = ["add_flags", "print_table", "summarize"]


def summarize(
    tally: Tally,
    extra: dict[str, Any],
    cfg: CacheConfig,
    requests: list[TraceRequest],
    *,
    block_tokens: int,
    storage: str,
    wall: float,
) -> dict[str, Any]:
    """The summary `--json` writes (and the table shows)."""
    hits = tally.device_hit + tally.host_hit
    summary: dict[str, Any] = {
        "requests": tally.requests,
        "input_tokens": tally.input_tokens,
        "hit_tokens": {
            "device": tally.device_hit,
            "host": tally.host_hit - tally.storage_hit,
            "storage": tally.storage_hit,
        },
        "hit_rate": hits / tally.input_tokens if tally.input_tokens else 0.0,
        "bound_hit_rate": bound_hit_rate(
            requests, block_tokens=block_tokens, page_size=cfg.page_size
        ),
        "bytes": {"d2h": 0, "h2d": 0, "h2s": 0, "s2h": 0, **extra.get("bytes", {})},
        "evictions": extra.get("evictions", {}),
        "storage_dropped_pages": extra.get("storage_dropped", {}),
        "rejected_requests": tally.rejected,
        "verified_pages": tally.verified_pages,
        "corrupt_pages": tally.corrupt_pages,
        "wall_s": round(wall, 3),
        "control_us_per_request": round(tally.control_s / max(tally.requests, 1) * 1e6, 1),
        "control_us_per_request_by_call": {
            name: round(s / max(tally.requests, 1) * 1e6, 1)
            for name, s in sorted(tally.control_by_call.items(), key=lambda kv: -kv[1])
        },
        "config": {
            "kv": cfg.kv,
            "page_size": cfg.page_size,
            "device_tokens": cfg.device_tokens,
            "host_tokens": cfg.host_capacity,
            "storage": redact_url(storage),
            "keyed_storage": any(
                x is not None for x in (cfg.secret, cfg.secret_env, cfg.secret_file)
            ),
            "encrypt_at_rest": cfg.encrypt_at_rest,
            "write_policy": cfg.write_policy,
            "eviction": cfg.eviction,
            "exclusive": cfg.exclusive,
            "prefetch_policy": cfg.prefetch_policy,
        },
    }
    if "backend" in extra:
        summary["storage_stats"] = extra["backend"]
        summary["storage_problems"] = storage_problems(extra["backend"])
    if tally.per_salt:  # requests spread over salts: each salt's own hit rate (live measure)
        summary["hit_rate_per_salt"] = {
            k: round(hit / max(total, 1), 4) for k, (total, hit) in sorted(tally.per_salt.items())
        }
    return summary


def storage_problems(stats: dict[str, Any]) -> dict[str, int]:
    """What went wrong in L3, from the backend's counters (names differ by backend): failed
    calls (errors, an unreachable or unavailable store) and values that failed verification
    (read as misses and deleted). Each is a miss or a skipped upload, never wrong KV."""
    errors = sum(int(stats.get(k, 0)) for k in ("errors", "unreachable", "unavailable"))
    return {"errors": errors, "corrupt_values": int(stats.get("corrupt", 0))}


def add_flags(
    summary: dict[str, Any],
    tally: Tally,
    extra: dict[str, Any],
    *,
    pin_tiers: tuple[str, ...],
    detach_at: int | None,
    attach_at: int | None,
    hybrid_spec: str | None,
) -> None:
    """Add to `summary` what only some flags bring: pins, L3 switched at run time, a hybrid
    model."""
    if pin_tiers:
        summary["config"]["pin_first_block"] = list(pin_tiers)
        summary["pins"] = {"first_blocks": len(tally.pinned), "refused": tally.pins_refused}
    for flag, value in (("detach_at", detach_at), ("attach_at", attach_at)):
        if value is not None:
            summary["config"][flag] = value
    if "hybrid" in extra:  # the pool's layers are the spec's attention layers (kv replaced)
        summary["hybrid"] = {"spec": hybrid_spec, **extra["hybrid"]}
        summary["config"]["hybrid"] = hybrid_spec


def print_table(s: dict[str, Any]) -> None:
    """The summary as the two-column table `hicache replay` prints."""
    tok = s["input_tokens"] or 1
    rejected = s["rejected_requests"]
    rows = [
        (
            "requests",
            f"{s['requests']}" + (f"  ({rejected} rejected: L1 too small)" if rejected else ""),
        ),
        ("input tokens", f"{s['input_tokens']:,}"),
        ("hit rate", f"{s['hit_rate']:.4f}  (cold-start bound {s['bound_hit_rate']:.4f})"),
        ("  from L1 (device)", f"{s['hit_tokens']['device'] / tok:.4f}"),
        ("  from L2 (host)", f"{s['hit_tokens']['host'] / tok:.4f}"),
        ("  from L3 (storage)", f"{s['hit_tokens']['storage'] / tok:.4f}"),
        ("bytes d2h / h2d", f"{s['bytes']['d2h']:,} / {s['bytes']['h2d']:,}"),
        ("bytes h2s / s2h", f"{s['bytes']['h2s']:,} / {s['bytes']['s2h']:,}"),
        (
            "evictions device / host",
            (f"{s['evictions'].get('device', 0):,} / {s['evictions'].get('host', 0):,} tokens"),
        ),
        ("verified / corrupt pages", f"{s['verified_pages']:,} / {s['corrupt_pages']}"),
        ("wall", f"{s['wall_s']:.2f} s"),
        ("time in cache calls", f"{s['control_us_per_request']:.0f} us/request"),
    ]
    by_call = s.get("control_us_per_request_by_call") or {}
    if by_call:
        rows.append(("  by call", ", ".join(f"{k} {v:,.0f}" for k, v in by_call.items())))
    link = s.get("link")
    if link is not None:  # bytes moved L1<->L2 over the wall, against the link's own copy rate
        moved = f"{link['moved_gbps']:.1f} GB/s moved in {link['run_s']:.2f} s"
        ref = f"{link['reference']}: {link['reference_gbps']:.1f} GB/s"
        rows.append(("link utilization", f"{link['utilization']:.2f} x  ({moved}; {ref})"))
    partial = s.get("partial")
    if partial is not None:
        rows.insert(
            0,
            (
                "PARTIAL",
                (
                    f"stopped by {partial['stopped_by']} after {s['requests']} of "
                    f"{partial['requests_in_trace']} requests"
                ),
            ),
        )
    hy = s.get("hybrid")
    if hy is not None:
        where = (
            "in a states cache"
            if "states_cache" in hy
            else f"{hy['pages_per_snapshot']} pool pages each"
        )
        kept_of = f"{hy['snapshots_offered']:,}  ({where})"
        rows.insert(1, ("hybrid", f"{hy['spec']}  (pool: kv {s['config']['kv']})"))
        rows += [
            ("K/V cut by the groups' rule", f"{hy['cut_tokens'] / tok:.4f}"),
            ("snapshots kept / offered", f"{hy['snapshots_kept']:,} / {kept_of}"),
            (
                "snapshot hits / probes",
                f"{hy['snapshot_hits']:,} / {hy['snapshot_probes']:,}",
            ),
            ("verified / corrupt states", f"{hy['verified_states']:,} / {hy['corrupt_states']}"),
        ]
        own = hy.get("states_cache")
        if own is not None:
            ev = own["evictions"]
            room = f"{own['device_snapshots']:,} / {own['host_snapshots']:,} snapshots"
            moved = f"evicted {ev['device']:,} / {ev['host']:,}, {own['h2s']:,} bytes to L3"
            rows.append(("states cache L1 / L2", f"{room}, {moved}"))
    problems = s.get("storage_problems")
    if problems is not None:
        rows.append(
            (
                "L3 errors / corrupt values",
                f"{problems['errors']:,} / {problems['corrupt_values']:,}  (misses; see --events)",
            )
        )
    dropped = s.get("storage_dropped_pages") or {}
    if dropped:  # pages that never reached L3: a store too slow, too full or too small
        why = ", ".join(f"{k} {v:,}" for k, v in sorted(dropped.items(), key=lambda kv: -kv[1]))
        rows.append(("L3 pages dropped", f"{sum(dropped.values()):,}  ({why})"))
    store = s.get("storage_stats", {})
    if "peak_stored_bytes" in store:  # a file store: how full it got against its cap
        sizes = (store["stored_bytes"], store["peak_stored_bytes"], store["max_bytes"])
        rows.append(("L3 bytes stored / peak / cap", " / ".join(f"{n:,}" for n in sizes)))
    per_salt = s.get("hit_rate_per_salt")
    if per_salt:
        rates = sorted(per_salt.values())
        rows.append(
            (f"hit rate per salt ({len(rates)})", f"{rates[0]:.4f} min / {rates[-1]:.4f} max")
        )
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for line in _NOTES:
        print(line)


_NOTES = (
    "cold-start bound: the hit rate of an unbounded cache that starts empty (a warm L3 can pass it)",
    "time in cache calls: wall time inside match ... insert per request (no model compute)",
)
