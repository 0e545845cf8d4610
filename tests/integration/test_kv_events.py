"""KV events in vLLM's wire format over ZMQ (hicache/observability/kv_events/).

The subscriber side is written here from vLLM's schema, as a router built for vLLM decodes
(its structs: events as tagged maps since vllm-project/vllm#42892, positional before), and
knows nothing of hicache. What it checks:

- a slice of the Mooncake trace through a cache with L1, L2 and L3: the batches a subscriber
  decodes are contiguous in sequence; a range it missed (it was gone, another joined late) is
  replayed from the ROUTER socket; the pages the events say each tier holds are, at the end
  of the slice, exactly what the tree's dump() says (GPU, CPU) and what the store holds
  (STORAGE), page hashes and token ids included, computed here independently; at close one
  AllBlocksCleared empties every tier;
- the wire details on a tree driven by hand: map and positional encodings, lora_name on the
  wire, block hashes as vLLM's ints (or bytes), parent hashes, replay answers to REQ and
  DEALER clients, the end marker.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import numpy as np
import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from hicache.cache import HiCache  # noqa: E402
from hicache.cli.trace import read_trace  # noqa: E402
from hicache.config import CacheConfig, ConfigError  # noqa: E402
from hicache.observability.kv_events import (  # noqa: E402
    KVEventPublisher,
    TreeKVEvents,
    start_kv_events,
)
from hicache.radix.hashes import chain_page_hashes  # noqa: E402
from hicache.types import RequestId  # noqa: E402
from tests.unit.radix.tree_helpers import SlotSource, make_tree, toks  # noqa: E402

TRACE = "data/mooncake_synthetic_trace.jsonl"

# ------------------------------------------------------------------------------ vLLM's side
# Copied from vLLM's schema (vllm/distributed/kv_events.py, after #42892); nothing of hicache.

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM 0.10's positional events (before lora_name): a decoder of this era must take the
# positional encoding, trailing fields it does not know included.
class OldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(OldKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldAllBlocksCleared(OldKVCacheEvent, tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(EventBatch):
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(KVEventBatch)
END = -1


def vllm_int(page_hash: str) -> int:
    """What vLLM sends for a 32-byte block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return int.from_bytes(bytes.fromhex(page_hash), "big") & ((1 << 64) - 1)


class Subscriber:
    """A SUB socket that keeps every batch it receives, by sequence, in arrival order."""

    def __init__(self, ctx, endpoint: str, topic: bytes = b"") -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)  # keep everything until read
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.topic = topic
        self.order: list[int] = []
        self.payloads: dict[int, bytes] = {}

    def drain_until(self, last: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while (not self.order or self.order[-1] < last) and time.monotonic() < deadline:
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                assert topic == self.topic and len(seq) == 8
                self.order.append(int.from_bytes(seq, "big"))
                self.payloads[self.order[-1]] = payload
        assert self.order and self.order[-1] >= last, f"got up to {self.order[-1:]}, want {last}"

    def close(self) -> None:
        self.sock.close(linger=0)


def replay(ctx, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """Ask the ROUTER for every buffered batch from `start` (a DEALER with the REQ envelope,
    so the whole answer can be read), up to the end marker."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(10_000), "no replay answer"
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            n = int.from_bytes(seq, "big", signed=True)
            if n == END:
                assert payload == b""
                return out
            out.append((n, payload))
    finally:
        sock.close(linger=0)


def contiguous(seqs: list[int]) -> bool:
    return seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True


def apply(payloads: dict[int, bytes], seqs) -> tuple[dict[str, set], dict[int, list[int]], dict]:
    """What a router would keep: per medium the hashes held; per hash its page's tokens and
    its parent hash (checked consistent every time a page is stored again)."""
    held: dict[str, set] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    tokens: dict[int, list[int]] = {}
    parents: dict[int, int | None] = {}
    counts: dict[str, int] = {}
    for seq in seqs:
        batch = DECODE.decode(payloads[seq])
        assert batch.data_parallel_rank == 0
        for ev in batch.events:
            kind = type(ev).__name__
            if isinstance(ev, BlockStored):
                kind += ":" + ev.medium
                ps = ev.block_size
                assert ev.lora_id is None and ev.lora_name is None and ev.medium in held
                assert len(ev.token_ids) == ps * len(ev.block_hashes) > 0
                for i, h in enumerate(ev.block_hashes):
                    assert h not in held[ev.medium], f"{h} stored twice on {ev.medium}"
                    held[ev.medium].add(h)
                    page = ev.token_ids[i * ps : (i + 1) * ps]
                    parent = ev.parent_block_hash if i == 0 else ev.block_hashes[i - 1]
                    assert tokens.setdefault(h, page) == page
                    assert parents.setdefault(h, parent) == parent
            elif isinstance(ev, BlockRemoved):
                kind += ":" + ev.medium
                gone = set(ev.block_hashes)
                assert gone <= held[ev.medium], f"removed from {ev.medium} what it never held"
                held[ev.medium] -= gone
            else:
                for s in held.values():
                    s.clear()
            counts[kind] = counts.get(kind, 0) + 1
    return held, tokens, counts


def tree_pages(tree) -> tuple[dict[str, set], dict[int, list[int]]]:
    """Per tier, the page hashes (as vLLM ints) the tree holds, from its dump and its keys,
    hashed here from the whole token path; and each page's tokens."""
    held: dict[str, set] = {"GPU": set(), "CPU": set()}
    tokens: dict[int, list[int]] = {}
    ps = tree.page_size
    for row in tree.dump()[1:]:
        parts, x = [], row["id"]
        while x != tree.root:
            parts.append(np.asarray(tree.key(x)))
            x = tree.parent(x)
        path = np.concatenate(parts[::-1])
        own = row["tokens"] // ps
        hashes = chain_page_hashes(path, ps)[-own:]
        pages = [path[len(path) - row["tokens"] + i * ps :][:ps].tolist() for i in range(own)]
        ints = [vllm_int(h) for h in hashes]
        tokens.update(zip(ints, pages))
        if row["state"] in ("device_only", "both"):
            held["GPU"].update(ints)
        if row["state"] in ("both", "host_only") and not row["backup_in_flight"]:
            held["CPU"].update(ints)
    return held, tokens


# ------------------------------------------------------------------------------ a trace slice


def slice_requests(count: int, block: int) -> list[tuple[RequestId, np.ndarray]]:
    """The first `count` requests of the shipped Mooncake trace with each 512-token block
    scaled down to `block` tokens (the prefix sharing is the trace's)."""
    out = []
    for req in read_trace(TRACE, limit=count):
        ids = np.asarray(req.hash_ids, dtype=np.int64)
        tokens = (ids[:, None] * block + np.arange(block)[None, :]).reshape(-1)
        out.append((RequestId(f"r{req.index}"), tokens[: -(-req.input_length * block // 512)]))
    return out


async def serve(cache: HiCache, requests) -> None:
    """Each request as a serving loop would: match, prefetch from L3, load back from L2,
    allocate, (compute), cache."""
    for rid, tokens in requests:
        await cache.match(rid, tokens)
        await cache.prefetch(rid, tokens)
        await cache.prefetch_wait(rid)
        lb = await cache.load_back(rid)
        if lb.handle is not None:
            await lb.handle.wait_async(cache.device_pool.geometry.layers - 1)
        new = await cache.allocate(rid, len(tokens) - len(lb.device_slots))
        await cache.cache_finished(rid, tokens, np.concatenate([lb.device_slots, new]))


def tree_of(cache: HiCache):
    # Until the facade wires kv_events itself, the test reaches the tree core through the
    # actor system's tree actor, between calls (nothing runs in the tree then).
    return cache.system.actors["tree"]._tree


@pytest.mark.parametrize("mode", ["write_through", "exclusive"])
def test_trace_slice_events_over_zmq(mode):
    cfg = CacheConfig(
        kv="mha:2:2:16:float16",
        page_size=16,
        device_tokens=8192,
        host_tokens=16384,
        write_policy="write_through" if mode == "write_through" else "write_back",
        exclusive=mode == "exclusive",
        storage="memory",
        model_id="kv-events-test",
        prefetch_threshold=16,
        prefetch_policy="wait_complete",
        kv_events="tcp://127.0.0.1:*",
        kv_events_replay="tcp://127.0.0.1:*",
        kv_events_topic="kv@test",
    )
    requests = slice_requests(150, block=32)
    ctx = zmq.Context()
    result: dict[str, Any] = {}

    async def main() -> None:
        async with HiCache(cfg) as cache:
            tree = tree_of(cache)
            kv = getattr(cache, "kv_events", None)  # the cache's own, once the facade wires it
            if kv is None:
                kv = result["own"] = start_kv_events(cache.config, tree, cache.system.log)
            assert kv is not None
            result["kv"] = kv
            pub = kv.publisher
            first = result["first"] = Subscriber(ctx, pub.endpoint, b"kv@test")
            await serve(cache, requests[:50])
            await cache.flush()
            assert kv.flush()
            first.drain_until(pub.next_seq - 1)
            first.close()  # gone: nobody hears what the next 50 requests change
            await serve(cache, requests[50:100])
            await cache.flush()
            assert kv.flush()
            missed_until = pub.next_seq
            second = result["second"] = Subscriber(ctx, pub.endpoint, b"kv@test")
            # The rest, then the first 30 again: long gone from L1 and L2, read back from L3.
            await serve(cache, requests[100:] + requests[:30])
            await cache.flush()
            assert kv.flush()
            assert (await cache.stats()).storage_hit_tokens > 0
            end = result["end"] = pub.next_seq
            second.drain_until(end - 1)

            # Live: each subscriber's batches are contiguous from the first it heard.
            assert contiguous(first.order) and contiguous(second.order)
            assert second.order[0] >= missed_until > first.order[-1] + 1
            # Replay what neither heard: before the first joined (a slow join), and the gap.
            payloads = result["payloads"] = {**first.payloads, **second.payloads}
            replayed = []
            for start, stop in ((0, first.order[0]), (first.order[-1] + 1, second.order[0])):
                got = replay(ctx, pub.replay_endpoint, start)
                assert [s for s, _ in got] == list(range(start, end))
                payloads.update((s, p) for s, p in got if s < stop)
                replayed += got
            assert all(payloads[s] == p for s, p in replayed)  # replayed = what was published
            # A REQ client (vLLM's example subscriber) gets the first batch it asked for.
            req = ctx.socket(zmq.REQ)
            req.connect(pub.replay_endpoint)
            req.send((first.order[-1] + 1).to_bytes(8, "big"))
            assert req.poll(10_000)
            seq, payload = req.recv_multipart()
            assert int.from_bytes(seq, "big") == first.order[-1] + 1
            assert payload == payloads[first.order[-1] + 1]
            req.close(linger=0)

            result["tree"] = tree_pages(tree)
            ns = cache.backend.namespace
            result["stored"] = {
                vllm_int(ns.page_hash_of(k)) for k in cache.backend.store.scan(ns.prefix)
            }
        # Closed: the tree was cleared, which one more batch says.
        assert kv.flush()
        second.drain_until(end)

    try:
        anyio.run(main)
        end, payloads, second = result["end"], result["payloads"], result["second"]
        held, tokens, counts = apply(payloads, range(end))
        expected, expected_tokens = result["tree"]
        assert held["GPU"] == expected["GPU"] and held["CPU"] == expected["CPU"]
        assert held["STORAGE"] == result["stored"]
        for h in expected["GPU"] | expected["CPU"]:
            assert tokens[h] == expected_tokens[h]
        # The slice moved pages every way the events can tell.
        for kind in (
            "BlockStored:GPU",
            "BlockRemoved:GPU",
            "BlockStored:CPU",
            "BlockRemoved:CPU",
            "BlockStored:STORAGE",
        ):
            assert counts.get(kind, 0) > 0, (kind, counts)
        # Close: one more batch, an AllBlocksCleared, after which the router holds nothing.
        assert result["kv"].publisher.next_seq == end + 1
        final, _, _ = apply(payloads | second.payloads, range(end + 1))
        assert final == {"GPU": set(), "CPU": set(), "STORAGE": set()}
        assert isinstance(DECODE.decode(second.payloads[end]).events[-1], AllBlocksCleared)
    finally:
        if "own" in result:
            result["own"].close()
        ctx.destroy(linger=0)  # every socket left, the subscribers' included


# ------------------------------------------------------------------------------ wire details


def _drive(tree, slots: SlotSource, host: SlotSource) -> dict[str, Any]:
    """Insert, back up, demote, load back, prefetch, drop a host copy, evict, clear."""
    first = slots.take(8)
    a = tree.insert(toks(*range(8)), first, now=1.0).last_node  # 2 pages of 4
    b = tree.insert(
        toks(*range(8), 50, 51, 52, 53), np.concatenate([first, slots.take(4)]), now=2.0
    ).last_node
    tree.begin_backup(a, host.take(8))
    tree.end_backup(a, ok=True)
    tree.evict_device(4, now=3.0)  # b: device only, removed
    tree.insert_host(
        a,
        toks(60, 61, 62, 63),
        host.take(4),
        chain_page_hashes([*range(8), 60, 61, 62, 63], 4)[-1:],
        now=4.0,
    )
    return {"a": a, "b": b}


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_wire_format(encoding):
    ctx = zmq.Context()
    pub = KVEventPublisher(
        "inproc://kv-events-wire",
        replay_endpoint="inproc://kv-replay",
        topic="t",
        encoding=encoding,
        context=ctx,
    )
    sub = Subscriber(ctx, "inproc://kv-events-wire", b"t")
    tree = make_tree(page_size=4, policy="write_through")
    kv = TreeKVEvents(tree, pub)
    try:
        _drive(tree, SlotSource(), SlotSource(1000))
        assert kv.flush()
        sub.drain_until(pub.next_seq - 1)
        # Replay from the start: every batch again (what was heard live, byte for byte), then
        # the end marker; from past the last batch, only the end marker.
        got = replay(ctx, "inproc://kv-replay", 0)
        assert [s for s, _ in got] == list(range(pub.next_seq))
        assert contiguous(sub.order) and all(
            sub.payloads[s] == p for s, p in got if s in sub.payloads
        )
        assert replay(ctx, "inproc://kv-replay", pub.next_seq) == []
        payloads = dict(got)
        hashes = [vllm_int(h) for h in chain_page_hashes([*range(8), 50, 51, 52, 53], 4)]
        prefetched = vllm_int(chain_page_hashes([*range(8), 60, 61, 62, 63], 4)[-1])
        raw = [msgspec.msgpack.decode(p) for _, p in got]
        events = [e for batch in raw for e in batch[1]]
        assert all(len(batch) == 3 and batch[2] == 0 for batch in raw)  # [ts, events, dp rank]
        if encoding == "map":
            stored = [e for e in events if e["type"] == "BlockStored"]
            assert all("lora_name" in e and e["lora_name"] is None for e in stored)
            decoded = [e for p in payloads.values() for e in DECODE.decode(p).events]
        else:
            assert all(isinstance(e, list) for e in events)
            old = msgspec.msgpack.Decoder(OldKVEventBatch)
            decoded = [e for p in payloads.values() for e in old.decode(p).events]
        summary = [
            (type(e).__name__.removeprefix("Old"), e.medium, list(e.block_hashes)) for e in decoded
        ]
        assert summary == [
            ("BlockStored", "GPU", hashes[:2]),
            ("BlockStored", "GPU", hashes[2:]),
            ("BlockStored", "CPU", hashes[:2]),
            ("BlockRemoved", "GPU", hashes[2:]),
            ("BlockStored", "CPU", [prefetched]),
            ("BlockStored", "STORAGE", [prefetched]),
        ]
        first, second = decoded[0], decoded[1]
        assert first.parent_block_hash is None and first.token_ids == list(range(8))
        assert second.parent_block_hash == hashes[1] and second.token_ids == [50, 51, 52, 53]
        assert decoded[4].parent_block_hash == hashes[1] and decoded[4].block_size == 4
        tree.clear()
        assert kv.flush()
        sub.drain_until(pub.next_seq - 1)
        last = msgspec.msgpack.decode(sub.payloads[sub.order[-1]])[1]
        assert last[-1] in ({"type": "AllBlocksCleared"}, ["AllBlocksCleared"])
        assert kv.held("GPU") == kv.held("CPU") == kv.held("STORAGE") == frozenset()
    finally:
        kv.close()
        sub.close()
        ctx.destroy(linger=0)
    assert tree.observer is None


def test_publisher_thread_idles_on_its_timer(monkeypatch):
    """Woken by flush and replay requests, the thread still blocks a whole batch_interval in
    each poll when nothing is queued (no busy loop competing for the GIL): every idle turn
    polls with the full interval as its timeout."""
    import threading

    timeouts: list[int] = []
    idle_turns = threading.Event()

    class RecordingPoller(zmq.Poller):
        def poll(self, timeout=None):
            ready = super().poll(timeout)
            if not ready:  # an idle turn: nothing queued, nothing asked
                timeouts.append(timeout)
                if len(timeouts) >= 3:
                    idle_turns.set()
            return ready

    monkeypatch.setattr(zmq, "Poller", RecordingPoller)
    ctx = zmq.Context()
    pub = KVEventPublisher(
        "inproc://kv-idle",
        replay_endpoint="inproc://kv-idle-replay",
        context=ctx,
        batch_interval=0.02,
    )
    try:
        pub.all_cleared()
        assert pub.flush() and pub.next_seq == 1
        assert [s for s, _ in replay(ctx, "inproc://kv-idle-replay", 0)] == [0]
        assert idle_turns.wait(timeout=30), "the publisher thread never went idle"
        assert timeouts and all(t == 20 for t in timeouts), timeouts
    finally:
        pub.close()
        ctx.destroy(linger=0)
    assert pub.dropped_events == 0
    pub.all_cleared()  # after close: dropped, counted
    assert pub.dropped_events == 1


@pytest.mark.parametrize("ending", ["tree.storage_cleared", "storage.detached"])
def test_upload_named_by_last_hash_is_storage(ending):
    """`uploader.stored` names the upload's pages by its last hash; they are published as
    STORAGE with their tokens; clear_storage (or detaching L3) removes every STORAGE page."""
    ctx = zmq.Context()
    pub = KVEventPublisher("inproc://kv-up", replay_endpoint="inproc://kv-up-replay", context=ctx)
    sub = Subscriber(ctx, "inproc://kv-up")
    tree = make_tree(page_size=4, policy="write_through")
    kv = TreeKVEvents(tree, pub, block_hash="bytes")
    try:
        slots, host = SlotSource(), SlotSource(1000)
        a = tree.insert(toks(*range(12)), slots.take(12), now=1.0).last_node
        tree.begin_backup(a, host.take(12))
        tree.end_backup(a, ok=True)
        page_hashes = chain_page_hashes(list(range(12)), 4)
        kv._on_log_event(
            {"event": "uploader.stored", "op": 1, "pages": 2, "last_hash": page_hashes[1]}
        )  # the first two pages' upload
        kv._on_log_event(
            {"event": "uploader.stored", "op": 2, "pages": 3, "last_hash": page_hashes[2]}
        )  # again, and one more
        kv._on_log_event({"event": ending})
        assert kv.flush()
        sub.drain_until(pub.next_seq - 1)
        got = replay(ctx, "inproc://kv-up-replay", 0)
        decoded = [e for _, p in got for e in DECODE.decode(p).events]
        storage = [e for e in decoded if e.medium == "STORAGE"]
        digests = [bytes.fromhex(h) for h in page_hashes]
        assert [(type(e).__name__, e.block_hashes) for e in storage] == [
            ("BlockStored", digests[:2]),
            ("BlockStored", digests[2:]),
            ("BlockRemoved", sorted(digests, key=lambda d: d.hex())),
        ]
        assert storage[0].parent_block_hash is None and storage[0].token_ids == list(range(8))
        assert storage[1].parent_block_hash == digests[1]
        assert storage[1].token_ids == [8, 9, 10, 11]
    finally:
        kv.close()
        sub.close()
        ctx.destroy(linger=0)


# ------------------------------------------------------------------------------ configuration


def test_config_fields():
    ok = CacheConfig(
        kv_events="tcp://*:5557",
        kv_events_replay="tcp://*:5558",
        kv_events_topic="kv@pod@model",
        kv_events_buffer=100,
        kv_events_format="array",
    )
    assert ok.resolve()[0] == ok
    CacheConfig(kv_events="tcp://127.0.0.1:*", kv_events_replay="tcp://127.0.0.1:*").resolve()
    for bad, field in [
        (dict(kv_events="localhost:5557"), "kv_events="),
        (dict(kv_events="tcp://"), "kv_events="),
        (dict(kv_events=5557), "kv_events="),
        (dict(kv_events_replay="tcp://*:5558"), "kv_events_replay is set"),
        (dict(kv_events="ipc:///tmp/k", kv_events_replay="ipc:///tmp/k"), "its own"),
        (dict(kv_events="tcp://*:1", kv_events_replay="http://x"), "kv_events_replay="),
        (dict(kv_events_topic=None), "kv_events_topic"),
        (dict(kv_events_buffer=0), "kv_events_buffer"),
        (dict(kv_events_format="json"), "kv_events_format"),
    ]:
        with pytest.raises(ConfigError, match=field):
            CacheConfig(**bad).resolve()


def test_start_kv_events_off():
    tree = make_tree(page_size=4)
    assert start_kv_events(CacheConfig(), tree) is None
    assert start_kv_events(CacheConfig(kv_events="inproc://x", tp_size=2, tp_rank=1), tree) is None
    assert tree.observer is None
