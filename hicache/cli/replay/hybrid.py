"""`hicache replay --hybrid SPEC`: the trace through `HybridCache` (hicache/hybrid/), so hit
rates per tier of a model with sliding-window or recurrent layers can be set against a
full-attention model of the same size.

SPEC lists the layer groups in model order, comma-separated: `full:N`, `sliding:N:WINDOW`,
`sliding:N:WINDOW:GRID` (only the window kept, in a snapshot every GRID tokens: WINDOW - 1
tokens of the N layers' K/V as the K/V spec sizes them), `recurrent:N:STATE_BYTES:GRID`
(STATE_BYTES: one snapshot of all N layers, 64KiB or 65536; GRID: tokens between snapshots, a
multiple of the page). The pool holds the layers kept as pages (full, and sliding without a
grid), so the K/V spec's layer count is replaced by theirs.

Each request runs alone, as an engine would run it through `HybridCache` (the batched path of
`command.py` has no hybrid counterpart): prefetch from L3 (storage on), match, check the hit's
K/V and snapshot, allocate, write the new K/V, cache it with a snapshot at every point of
`snapshot_points` above the hit and at the hit's `snapshot_hint` (where the prompt branches
off the cached K/V), as docs/hybrid.md asks of an engine. The stand-in state after a prefix is a hash of its tokens,
so a snapshot handed back for the wrong prefix is caught (`corrupt_states`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

import numpy as np

from hicache.backends.keys import check_kv_spec
from hicache.backends.mooncake.spec import parse_size
from hicache.cli.replay.step import Timer
from hicache.cli.tally import Tally
from hicache.cli.trace import TraceRequest
from hicache.config import ConfigError
from hicache.hybrid import FullAttention, HybridCache, HybridModel, Recurrent, SlidingWindow
from hicache.hybrid.groups import LayerGroup
from hicache.kernels.geometry import parse_geometry
from hicache.radix.hashes import chain_page_hashes
from hicache.results import CapacityError
from hicache.testing.kvfill import count_bad_pages, fill, page_seeds
from hicache.types import RequestId

__all__ = [
    "HybridTally",
    "hybrid_kv",
    "parse_hybrid",
    "parse_state_snapshots",
    "prefix_states",
    "run_hybrid_request",
    "run_hybrid_step",
]

_FORMS = "full:N, sliding:N:WINDOW[:GRID] or recurrent:N:STATE_BYTES:GRID"


def _count(text: str, what: str, item: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--hybrid {item!r}: {what} must be a positive integer, got {text!r}")
    return n


def parse_hybrid(spec: str, page_size: int, kv: str | None = None) -> HybridModel:
    """The `HybridModel` of `--hybrid SPEC`, layers numbered in the order given; `kv` sizes a
    windowed sliding group's snapshot part. ValueError naming the item (or the model's own
    check) that is wrong."""
    groups: list[LayerGroup] = []
    first = 0
    for item in (part.strip() for part in spec.split(",")):
        kind, *rest = item.split(":")
        arities = {"full": (1,), "sliding": (2, 3), "recurrent": (3,)}.get(kind, ())
        if len(rest) not in arities:
            raise ValueError(f"--hybrid {item!r}: expected {_FORMS}")
        n = _count(rest[0], "the layer count", item)
        layers = tuple(range(first, first + n))
        first += n
        if kind == "full":
            groups.append(FullAttention(layers))
        elif kind == "sliding" and len(rest) == 2:
            groups.append(SlidingWindow(layers, window=_count(rest[1], "the window", item)))
        elif kind == "sliding":
            window, grid = _count(rest[1], "the window", item), _count(rest[2], "the grid", item)
            if kv is None:
                raise ValueError(f"--hybrid {item!r}: a windowed group needs the K/V spec")
            geometry = parse_geometry(check_kv_spec(kv))
            tail = (window - 1) * n * (geometry.bytes_per_token // geometry.layers)
            groups.append(SlidingWindow(layers, window, state_bytes=max(tail, 1), grid=grid))
        else:
            state = parse_size(rest[1], f"--hybrid {item!r}: the state size")
            grid = _count(rest[2], "the grid", item)
            groups.append(Recurrent(layers, state_bytes=state, grid=grid))
    try:
        return HybridModel(tuple(groups), page_size)
    except ConfigError as exc:
        raise ValueError(f"--hybrid {spec!r}: {exc}") from None


def parse_state_snapshots(
    text: str | None, model: HybridModel | None
) -> tuple[int | None, int | None] | None:
    """`--state-snapshots L1:L2` (snapshots a states cache holds per tier) or `auto`
    (state_config's defaults) as (L1, L2); None without the flag. ValueError naming what is
    wrong."""
    if text is None:
        if model is not None and not model.pool_layers:  # no pool bytes to hold snapshots
            raise ValueError("--hybrid with no layer kept as pages needs --state-snapshots")
        return None
    if model is None or not model.stateful:
        raise ValueError(
            "--state-snapshots needs --hybrid with a recurrent or windowed sliding group"
        )
    if text == "auto":
        return None, None
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError(f"--state-snapshots {text!r}: expected L1:L2 (e.g. 64:512) or auto")
    l1, l2 = (_count(part, "a snapshot count", text) for part in parts)
    return l1, l2


def hybrid_kv(kv: str, model: HybridModel) -> str:
    """`kv` with its layer count replaced by the model's attention layers (the pool's)."""
    kind, _layers, *rest = check_kv_spec(kv).split(":")
    return ":".join([kind, str(len(model.pool_layers)), *rest])


def prefix_states(tokens: np.ndarray, points: Iterable[int], size: int) -> dict[int, bytes]:
    """The stand-in recurrent state after tokens[:p] for each p: `size` bytes spun from a
    SHA-256 of the prefix (one pass over the tokens for all points)."""
    h = hashlib.sha256()
    at = 0
    out: dict[int, bytes] = {}
    for p in sorted(points):
        h.update(np.ascontiguousarray(tokens[at:p], dtype=np.int64).tobytes())
        at = p
        digest = h.copy().digest()
        out[p] = (digest * (size // len(digest) + 1))[:size]
    return out


@dataclass(slots=True)
class HybridTally:
    """What a hybrid replay adds to the summary. `cut_tokens`: K/V the cache held (whole
    pages below the last token) beyond the hit the groups' rule allowed; `snapshot_hits`:
    requests whose hit carried a snapshot; `snapshots_kept`: points cache_finished kept
    (stored now or found already there)."""

    snapshot_hits: int = 0
    snapshots_kept: int = 0
    snapshots_offered: int = 0
    snapshot_probes: int = 0
    cut_tokens: int = 0
    verified_states: int = 0
    corrupt_states: int = 0

    def add(self, other: HybridTally) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


async def run_hybrid_request(
    hc: HybridCache,
    req: TraceRequest,
    tokens: np.ndarray,
    salt: str | None,
    *,
    storage_on: bool,
    verify: bool,
    timer: Timer,
) -> tuple[dict[str, int], HybridTally]:
    """One request through `hc`. Returns its counts (`device`, `host`, `storage`: hit tokens
    per tier; `verified_pages`, `corrupt_pages`) and its hybrid tally. CapacityError
    (nothing kept for it) when L1 cannot take its new tokens."""
    cache, model = hc.cache, hc.model
    pool, page = cache.device_pool, model.page_size
    rid = RequestId(f"r{req.index}")
    seeds = (
        np.append(page_seeds(chain_page_hashes(tokens[: len(tokens) // page * page], page)), 0)
        if verify
        else np.zeros(0, dtype=np.int64)
    )
    with timer("match_prefetch"):
        before = len(tokens)  # L1+L2 before the prefetch: the hit beyond it came from L3
        if storage_on:
            found = await cache.match(rid, tokens, salt=salt)
            before = found.device_len + found.host_len
            await hc.prefetch(rid, tokens, salt=salt)
        hit = await hc.match(rid, tokens, salt=salt)
    ht = HybridTally(snapshot_probes=hit.probes)
    ht.cut_tokens = model.cap(len(tokens), hit.kv_len) - hit.length
    counts = {"verified_pages": 0, "corrupt_pages": 0}
    if verify:
        counts["corrupt_pages"] = count_bad_pages(
            pool, hit.device_slots, seeds, page_size=page, first=0
        )
        counts["verified_pages"] = hit.length // page
    if hit.state is not None:
        ht.snapshot_hits = 1
        if verify:
            want = prefix_states(tokens, [hit.length], model.state_bytes)[hit.length]
            ht.verified_states = 1
            ht.corrupt_states = int(hit.state != want)
    try:
        with timer("allocate"):
            fresh = await hc.allocate(rid, len(tokens) - hit.length)
    except CapacityError:
        await hc.release(rid)
        raise
    if verify:
        fill(pool, fresh, seeds, page_size=page, first=hit.length)
    # The grid and the end, and where this prompt branches off what was cached (the hint):
    # a snapshot there lets the next prompt sharing the prefix resume from it.
    hint = [] if hit.snapshot_hint is None else [hit.snapshot_hint]
    points = sorted({p for p in [*model.snapshot_points(len(tokens)), *hint] if p > hit.length})
    states = prefix_states(tokens, points, model.state_bytes) if points else {}
    with timer("cache"):
        _, kept = await hc.cache_finished(
            rid,
            tokens,
            np.concatenate([hit.device_slots, fresh]),
            snapshots=states,
            salt=salt,
        )
    ht.snapshots_offered, ht.snapshots_kept = len(states), len(kept)
    storage = max(0, hit.length - max(before, hit.device_hit))
    counts.update(
        device=hit.device_hit,
        host=hit.length - hit.device_hit - storage,
        storage=storage,
    )
    return counts, ht


async def run_hybrid_step(
    hc: HybridCache,
    step: list[TraceRequest],
    tally: Tally,
    timer: Timer,
    *,
    block_tokens: int,
    verify: bool,
    storage_on: bool,
    salts: int = 0,
) -> None:
    """A scheduler step's requests one by one through `hc`, counted into `tally` (its
    `host_hit` holds L2 and L3 hits, `storage_hit` the L3 part, as the summary expects) and
    `tally.extra["hybrid"]`; a request L1 cannot take is rejected."""
    total = tally.extra.setdefault("hybrid", HybridTally())
    for req in step:
        tokens = req.tokens(block_tokens)
        salt = f"salt-{req.index % salts}" if salts else None
        tally.requests += 1
        tally.input_tokens += len(tokens)
        try:
            counts, ht = await run_hybrid_request(
                hc, req, tokens, salt, storage_on=storage_on, verify=verify, timer=timer
            )
        except CapacityError:
            tally.rejected += 1
            continue
        hit = counts["device"] + counts["host"] + counts["storage"]
        tally.device_hit += counts["device"]
        tally.host_hit += counts["host"] + counts["storage"]
        tally.storage_hit += counts["storage"]
        tally.loaded += hit - counts["device"]
        tally.verified_pages += counts["verified_pages"]
        tally.corrupt_pages += counts["corrupt_pages"]
        total.add(ht)
        if salts:
            per = tally.per_salt.setdefault(salt or "", [0, 0])
            per[0] += len(tokens)
            per[1] += hit
