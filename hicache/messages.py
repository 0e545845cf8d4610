"""Every message exchanged between the cache's actors, one union per inbox.

Messages are frozen, slotted, keyword-only dataclasses carrying ids, slot arrays and plain
values, never a reference to another actor's objects. A message that carries a `reply` is a
request (it flows downward: frontend -> tree -> loader); everything flowing back up
is a fire-and-forget completion that the sender's credits guarantee room for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from hicache.types import OpId, PageHash, RequestId

if TYPE_CHECKING:
    from hicache.backends.base import StorageBackend
    from hicache.kernels.streams.base import LoadHandle
    from hicache.results import (
        CacheOutcome,
        CacheStats,
        ClearOutcome,
        LoadBackOutcome,
        MatchOutcome,
        PinOutcome,
        PrefetchOutcome,
    )
    from hicache.runtime import Reply

_T = TypeVar("_T")


class Asks(Protocol[_T]):
    """A request: a message carrying the reply its sender waits on. A sender that builds one
    with `make(reply)` gets the reply's type from the message (`ActorSystem.request`, the facade).
    """

    @property
    def reply(self) -> Reply[_T]: ...


# ---------------------------------------------------------------- frontend -> tree (requests)
@dataclass(frozen=True, slots=True, kw_only=True)
class MatchItem:
    rid: RequestId
    tokens: Any  # sequence or int ndarray of token ids (tuples for bigram keys)
    salt: bytes = b""  # pages cached under one salt are found only under the same salt
    # retention ranges (start, end, priority, duration; end and duration may be inf)
    retention: tuple[tuple[int, float, int, float], ...] = ()
    threshold: int | None = None  # prefetch only: this request's threshold (None: the config's)


@dataclass(frozen=True, slots=True, kw_only=True)
class MatchBatch:
    items: tuple[MatchItem, ...]
    reply: Reply[tuple[MatchOutcome, ...]]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadBackBatch:
    rids: tuple[RequestId, ...]
    reply: Reply[tuple[LoadBackOutcome, ...]]
    threshold: int | None = None  # fewest L2 tokens worth loading (None: the config's)


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocBatch:
    sizes: tuple[tuple[RequestId, int], ...]
    reply: Reply[tuple[np.ndarray, ...]]


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheItem:
    rid: RequestId
    tokens: Any
    device_slots: np.ndarray  # one per token, the request's whole sequence so far
    finished: bool  # False: a chunk of an unfinished request (no hit count, lock moves)
    salt: bytes = b""  # must be the salt the request was matched under
    backup: bool = False  # back the path up to L2 now, whatever the write policy


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheBatch:
    items: tuple[CacheItem, ...]
    reply: Reply[tuple[CacheOutcome, ...]]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseBatch:
    rids: tuple[RequestId, ...]
    reply: Reply[None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Flush:
    reply: Reply[bool | None]  # None once flushed; with `poll`, whether flushed
    poll: bool = False  # answer at once whether nothing is pending (TP ranks poll)


@dataclass(frozen=True, slots=True, kw_only=True)
class GetStats:
    reply: Reply[CacheStats]


@dataclass(frozen=True, slots=True, kw_only=True)
class DumpTree:
    reply: Reply[list[dict[str, Any]]]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefetchBatch:
    items: tuple[MatchItem, ...]
    reply: Reply[tuple[PrefetchOutcome, ...]]


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefetchWait:
    rid: RequestId
    reply: Reply[PrefetchOutcome]  # answered when the prefetch may terminate by the policy
    poll: bool = False  # answer at once with the outcome so far (TP ranks poll)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefetchPoll:
    rid: RequestId
    reply: Reply[PrefetchOutcome]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClearStorage:
    reply: Reply[bool]


# ---------------------------------------------------------------- attach / detach L3 at run time
@dataclass(frozen=True, slots=True, kw_only=True)
class StorageAttachment:
    """An L3 backend attached to the cache: the backend (sealed as the cache seals), its spec
    as events show it (password redacted), and whether the cache opened it (then the cache
    closes it, on detach or at close; a caller's backend is the caller's to close)."""

    backend: StorageBackend
    spec: str
    owned: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class AttachStorage:
    """Turn L3 on with `storage`, in call order; answered False (nothing changed) when a
    backend is attached already."""

    storage: StorageAttachment
    reply: Reply[bool]


@dataclass(frozen=True, slots=True, kw_only=True)
class DetachStorage:
    """Turn L3 off for new work at once; answered, with what was attached, once no upload or
    prefetch of it is in flight (None: nothing was attached)."""

    reply: Reply[StorageAttachment | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Clear:
    """Drop every unlocked page of `tiers` once nothing is in flight."""

    tiers: tuple[str, ...]
    reply: Reply[ClearOutcome | None]  # None while work is in flight (with `poll`)
    poll: bool = False  # answer None at once while work is in flight (TP ranks poll)


@dataclass(frozen=True, slots=True, kw_only=True)
class Pin:
    """Pin a prefix in some tiers (see `pins.py`); answers a PinOutcome."""

    tokens: Any
    salt: bytes
    tiers: tuple[str, ...]
    ttl: float | None
    reply: Reply[PinOutcome]


@dataclass(frozen=True, slots=True, kw_only=True)
class Unpin:
    tokens: Any
    salt: bytes
    reply: Reply[bool]  # False: no pin of exactly that prefix


@dataclass(frozen=True, slots=True, kw_only=True)
class Drain:
    """Close: finish in-flight work, then answer with the final ledger balance."""

    # The ledgers (tier -> size, used, ...) and the bookkeeping tables (name -> entries) once
    # nothing is in flight; None while something is (with `poll`).
    reply: Reply[tuple[dict[str, dict[str, int]], dict[str, int]] | None]
    poll: bool = False  # answer None at once while work is in flight (TP ranks poll)
    # Past the close deadline: end every op still in flight as abandoned (with an event) and
    # answer at once. Only for close: the workers are stopped right after.
    abandon: bool = False


# ---------------------------------------------------------------- workers -> tree (completions)
@dataclass(frozen=True, slots=True, kw_only=True)
class WriteDone:
    """The end of one stream job of backups: every op in it ended alike (one copy)."""

    ops: tuple[OpId, ...]
    ok: bool
    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadDone:
    op: OpId
    ok: bool
    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class UploadDone:
    op: OpId
    stored_pages: int
    # why pages were not stored (with stored_pages short): "store_full" (the store refused
    # writes: it is full and backing off), "failed" (after the retries), "timed_out"
    dropped: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefetchProgress:
    op: OpId
    hit_pages: int  # pages present in storage (consecutive prefix), known after the probe
    done_pages: int  # pages read and verified so far (consecutive prefix)
    finished: bool  # no I/O of this op is in flight or will start
    stopped: bool = False  # sent after the prefetcher took a StopPrefetch


@dataclass(frozen=True, slots=True, kw_only=True)
class TimerFired:
    op: OpId


@dataclass(frozen=True, slots=True, kw_only=True)
class UploadTimedOut:
    """The upload's storage call passed `storage_timeout` and was given up: it no longer
    counts as pending for flushes or host allocations. Its `UploadDone` still follows once the
    call has really returned; until then its host pages stay protected (the call may still
    read them)."""

    op: OpId


# ---------------------------------------------------------------- allocator -> tree (leases)
@dataclass(frozen=True, slots=True, kw_only=True)
class HostSlotsReady:
    """Host slots [start, stop) (whole pages) are prepared: faulted in, and pinned where CUDA
    is. The tree's host ledger may hand them out from now on."""

    start: int
    stop: int


TreeInbox = (
    MatchBatch
    | LoadBackBatch
    | AllocBatch
    | CacheBatch
    | ReleaseBatch
    | Flush
    | GetStats
    | DumpTree
    | PrefetchBatch
    | PrefetchWait
    | PrefetchPoll
    | ClearStorage
    | Clear
    | Pin
    | Unpin
    | Drain
    | AttachStorage
    | DetachStorage
    | WriteDone
    | LoadDone
    | UploadDone
    | UploadTimedOut
    | PrefetchProgress
    | TimerFired
    | HostSlotsReady
)


# ---------------------------------------------------------------- allocator -> allocator
@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkPrepared:
    """The allocator's preparing task is done with host slots [start, stop): ready, or (with
    `error`) their registration failed and they must not be used."""

    start: int
    stop: int
    seconds: float  # the kernel's clock, spent preparing this chunk
    error: str | None = None


AllocatorInbox = ChunkPrepared


# ---------------------------------------------------------------- tree -> writer / loader
@dataclass(frozen=True, slots=True, kw_only=True)
class Backup:
    """One L1 -> L2 copy the controller issued (one op, one write credit)."""

    op: OpId
    device_slots: np.ndarray
    host_slots: np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True)
class Backups:
    """The backups one controller step issued, sent as one message: the writer copies them as
    one stream job and reports them in one `WriteDone` (a hop per step, not per backup). Each
    keeps its own op, credit and `writer.backup_done` event."""

    jobs: tuple[Backup, ...]

    @property
    def op(self) -> OpId:  # the stream job's key in the writer: the first op's
        return self.jobs[0].op


@dataclass(frozen=True, slots=True, kw_only=True)
class Load:
    op: OpId
    host_slots: np.ndarray
    device_slots: np.ndarray
    reply: Reply[LoadHandle]  # answered as soon as the copy is queued


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamDone:
    """A transfer stream finished a job (delivered from the stream's thread or timer)."""

    op: OpId
    error: str = ""


WriterInbox = Backups | StreamDone
LoaderInbox = Load | StreamDone


# ---------------------------------------------------------------- tree -> uploader / prefetcher
@dataclass(frozen=True, slots=True, kw_only=True)
class Upload:
    op: OpId
    hashes: tuple[PageHash, ...]
    host_slots: np.ndarray
    ttl: float | None = None  # seconds the values should live (a retention range's rest)


@dataclass(frozen=True, slots=True, kw_only=True)
class StartPrefetch:
    """Probe storage for these pages; report how many are there, then wait for a ReadPrefetch."""

    op: OpId
    hashes: tuple[PageHash, ...]  # pages wanted, in order


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadPrefetch:
    """Read the probed pages into these host slots (page-aligned, one page per hit)."""

    op: OpId
    host_slots: np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True)
class StopPrefetch:
    op: OpId


@dataclass(frozen=True, slots=True, kw_only=True)
class IoDone:
    """A storage call made by a worker's helper task finished."""

    op: OpId
    pages: int
    error: str = ""
    refused: bool = False  # the store would not take writes now (full): no retry helps


@dataclass(frozen=True, slots=True, kw_only=True)
class IoDeadline:
    """The deadline of an op's storage call `call` (a per-op count) has passed."""

    op: OpId
    call: int


@dataclass(frozen=True, slots=True, kw_only=True)
class UseBackend:
    """From now on make storage calls to `backend` (None: storage detached). Sent by the tree
    only while the worker has nothing in flight."""

    backend: StorageBackend | None


UploaderInbox = Upload | IoDone | IoDeadline | UseBackend
PrefetcherInbox = StartPrefetch | ReadPrefetch | StopPrefetch | IoDone | IoDeadline | UseBackend

__all__ = [name for name in dir() if name[0].isupper()]
