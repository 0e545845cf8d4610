"""Every message exchanged between the cache's actors, one union per inbox.

Messages are frozen, slotted, keyword-only dataclasses carrying ids, slot arrays and plain
values, never a reference to another actor's objects. A message that carries a `reply` is a
request (it flows downward: frontend -> tree -> allocator/loader); everything flowing back up
is a fire-and-forget completion that the sender's credits guarantee room for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from hicache.types import NodeId, OpId, PageHash, RequestId

if TYPE_CHECKING:
    from hicache.runtime import Reply

_msg = dataclass(frozen=True, slots=True, kw_only=True)


# ---------------------------------------------------------------- frontend -> tree (requests)
@_msg
class MatchItem:
    rid: RequestId
    tokens: Any  # sequence or int ndarray of token ids (tuples for bigram keys)


@_msg
class MatchBatch:
    items: tuple[MatchItem, ...]
    reply: Reply


@_msg
class LoadBackBatch:
    rids: tuple[RequestId, ...]
    reply: Reply


@_msg
class AllocBatch:
    sizes: tuple[tuple[RequestId, int], ...]
    reply: Reply


@_msg
class CacheItem:
    rid: RequestId
    tokens: Any
    device_slots: np.ndarray  # one per token, the request's whole sequence so far
    finished: bool  # False: a chunk of an unfinished request (no hit count, lock moves)


@_msg
class CacheBatch:
    items: tuple[CacheItem, ...]
    reply: Reply


@_msg
class ReleaseBatch:
    rids: tuple[RequestId, ...]
    reply: Reply


@_msg
class Flush:
    reply: Reply
    poll: bool = False  # answer at once whether nothing is pending (TP ranks poll)


@_msg
class GetStats:
    reply: Reply


@_msg
class DumpTree:
    reply: Reply


@_msg
class PrefetchBatch:
    items: tuple[MatchItem, ...]
    reply: Reply


@_msg
class PrefetchWait:
    rid: RequestId
    reply: Reply  # answered when the prefetch may terminate by the policy
    poll: bool = False  # answer at once with the outcome so far (TP ranks poll)


@_msg
class PrefetchPoll:
    rid: RequestId
    reply: Reply


@_msg
class ClearStorage:
    reply: Reply


@_msg
class Drain:
    """Close: finish in-flight work, then answer with the final ledger balance."""

    reply: Reply
    poll: bool = False  # answer None at once while work is in flight (TP ranks poll)
    # Past the close deadline: end every op still in flight as abandoned (with an event) and
    # answer at once. Only for close: the workers are stopped right after.
    abandon: bool = False


# ---------------------------------------------------------------- workers -> tree (completions)
@_msg
class WriteDone:
    op: OpId
    ok: bool
    error: str = ""


@_msg
class LoadDone:
    op: OpId
    ok: bool
    error: str = ""


@_msg
class UploadDone:
    op: OpId
    stored_pages: int


@_msg
class PrefetchProgress:
    op: OpId
    hit_pages: int  # pages present in storage (consecutive prefix), known after the probe
    done_pages: int  # pages read and verified so far (consecutive prefix)
    finished: bool  # no I/O of this op is in flight or will start
    stopped: bool = False  # sent after the prefetcher took a StopPrefetch


@_msg
class TimerFired:
    op: OpId


@_msg
class UploadTimedOut:
    """The upload's storage call passed `storage_timeout` and was given up: it no longer
    counts as pending for flushes or host allocations. Its `UploadDone` still follows once the
    call has really returned; until then its host pages stay protected (the call may still
    read them)."""

    op: OpId


TreeInbox = Union[
    MatchBatch, LoadBackBatch, AllocBatch, CacheBatch, ReleaseBatch, Flush, GetStats, DumpTree,
    PrefetchBatch, PrefetchWait, PrefetchPoll, ClearStorage, Drain,
    WriteDone, LoadDone, UploadDone, UploadTimedOut, PrefetchProgress, TimerFired,
]


# ---------------------------------------------------------------- tree -> allocator (requests)
@_msg
class Alloc:
    tier: str  # "device" | "host"
    num_tokens: int
    reply: Reply  # -> np.ndarray | None


@_msg
class Free:
    tier: str
    slots: np.ndarray


@_msg
class LedgerStats:
    reply: Reply


AllocatorInbox = Union[Alloc, Free, LedgerStats]


# ---------------------------------------------------------------- tree -> writer / loader
@_msg
class Backup:
    op: OpId
    device_slots: np.ndarray
    host_slots: np.ndarray
    reply: Reply | None = None  # answered ok: bool (besides WriteDone); an eviction may wait


@_msg
class Load:
    op: OpId
    host_slots: np.ndarray
    device_slots: np.ndarray
    reply: Reply  # -> LoadHandle, answered as soon as the copy is queued


@_msg
class StreamDone:
    """A transfer stream finished a job (delivered from the stream's thread or timer)."""

    op: OpId
    error: str = ""


WriterInbox = Union[Backup, StreamDone]
LoaderInbox = Union[Load, StreamDone]


# ---------------------------------------------------------------- tree -> uploader / prefetcher
@_msg
class Upload:
    op: OpId
    hashes: tuple[PageHash, ...]
    host_slots: np.ndarray
    reply: Reply | None = None  # answered with the pages stored (besides UploadDone)


@_msg
class StartPrefetch:
    """Probe storage for these pages; report how many are there, then wait for a ReadPrefetch."""

    op: OpId
    hashes: tuple[PageHash, ...]  # pages wanted, in order


@_msg
class ReadPrefetch:
    """Read the probed pages into these host slots (page-aligned, one page per hit)."""

    op: OpId
    host_slots: np.ndarray


@_msg
class StopPrefetch:
    op: OpId


@_msg
class IoDone:
    """A storage call made by a worker's helper task finished."""

    op: OpId
    pages: int
    error: str = ""


@_msg
class IoDeadline:
    """The deadline of an op's storage call `call` (a per-op count) has passed."""

    op: OpId
    call: int


UploaderInbox = Union[Upload, IoDone, IoDeadline]
PrefetcherInbox = Union[StartPrefetch, ReadPrefetch, StopPrefetch, IoDone, IoDeadline]

__all__ = [name for name in dir() if name[0].isupper()]
