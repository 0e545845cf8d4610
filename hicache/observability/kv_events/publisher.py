"""`KVEventPublisher`: queues KV events from any thread and sends them in batches from its own."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import zmq

from hicache.observability.kv_events.transport import answer_replay, close_sockets, open_sockets
from hicache.observability.kv_events.wire import (
    EVENT_CLASSES,
    MAX_HASHES_PER_EVENT,
    EventBatch,
    ExternalBlockHash,
)

_logger = logging.getLogger("hicache.kv_events")


class KVEventPublisher:
    """Batches KV events and sends them on a ZMQ PUB socket from a thread of its own, keeping
    the last `buffer_steps` batches to answer replay requests on a ROUTER socket.

    `stored`, `removed`, `all_cleared` and `defer` may be called from any thread and never
    block or make a system call: they append to a list. Every `batch_interval` seconds the
    thread takes what has queued and sends it as one batch (at most `max_batch_events` events
    a batch), so the thread wakes on a timer, not per event, and what is costly to build is
    built there (`defer`). `flush()` waits until everything queued so far is sent; `close()`
    sends what is queued and stops.

    `endpoint` binds when it has a wildcard (`tcp://*:5557`, `tcp://127.0.0.1:*` for any free
    port) or is ipc/inproc, and connects otherwise (vLLM's rule); `replay_endpoint` always
    binds. `self.endpoint` / `self.replay_endpoint` are the addresses actually bound.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = 0,
        encoding: Literal["map", "array"] = "map",
        max_batch_events: int = 1024,
        batch_interval: float = 0.01,
        linger: float = 1.0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if encoding not in EVENT_CLASSES:
            raise ValueError(f"encoding={encoding!r} must be 'map' or 'array'")
        if buffer_steps < 1 or max_batch_events < 1:
            raise ValueError("buffer_steps and max_batch_events must be >= 1")
        if not batch_interval > 0:
            raise ValueError(f"batch_interval={batch_interval!r} must be > 0 seconds")
        self._interval_ms = max(1, round(batch_interval * 1000))
        self._stored_cls, self._removed_cls, self._cleared_cls = EVENT_CLASSES[encoding]
        self.encoding = encoding
        self._topic = topic.encode("utf-8")
        self._dp_rank = data_parallel_rank
        self._max_batch = max_batch_events
        ctx = context if context is not None else zmq.Context.instance()
        self._pub, self.endpoint, self._replay, self.replay_endpoint = open_sockets(
            ctx, endpoint, replay_endpoint, hwm=hwm, linger=linger, buffer_steps=buffer_steps
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)  # the thread's
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._cond = threading.Condition()
        self._pending: list[Any] = []  # events, and thunks making lists of events (defer)
        self._closing = False
        self._dead = False
        self._queued = 0  # items (events, deferred makers) accepted so far
        self._sent = 0  # items published so far
        self._next_seq = 0
        self.published_batches = 0
        self.dropped_events = 0  # queued after close
        self.errors = 0  # failed sends, bad replay requests
        self.wakeups = 0  # the thread's loop turns: about one per batch_interval when idle
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- producers (any thread)
    def stored(
        self,
        block_hashes: list[ExternalBlockHash],
        parent: ExternalBlockHash | None,
        token_ids: list[int],
        block_size: int,
        medium: str,
    ) -> None:
        self._put(self.stored_event(block_hashes, parent, token_ids, block_size, medium))

    def removed(self, block_hashes: list[ExternalBlockHash], medium: str) -> None:
        for event in self.removed_events(block_hashes, medium):
            self._put(event)

    def all_cleared(self) -> None:
        self._put(self._cleared_cls())

    def defer(self, make: Callable[[], list[Any]]) -> None:
        """Queue `make`, called on the publisher's thread when the batch is cut, for the events
        it returns (made with `stored_event` / `removed_events`), in place: what is costly to
        build (token lists, hash conversions) is not built on the caller's thread. `make` must
        only read what nobody changes."""
        self._put(make)

    def stored_event(
        self,
        block_hashes: list[ExternalBlockHash],
        parent: ExternalBlockHash | None,
        token_ids: list[int],
        block_size: int,
        medium: str,
    ) -> Any:
        return self._stored_cls(
            block_hashes=block_hashes,
            parent_block_hash=parent,
            token_ids=token_ids,
            block_size=block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )

    def removed_events(self, block_hashes: list[ExternalBlockHash], medium: str) -> list[Any]:
        """One BlockRemoved per 4096 hashes."""
        return [
            self._removed_cls(
                block_hashes=block_hashes[i : i + MAX_HASHES_PER_EVENT], medium=medium
            )
            for i in range(0, len(block_hashes), MAX_HASHES_PER_EVENT)
        ]

    def _put(self, item: Any) -> None:
        with self._cond:
            if self._closing or self._dead:
                self.dropped_events += 1
                return
            self._pending.append(item)
            self._queued += 1

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (the thread is already awake) or closed (closing)
            pass

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get (batches sent so far)."""
        with self._cond:
            return self._next_seq

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until every event queued before the call has been sent (within a
        `batch_interval`). False on timeout, or when the thread has stopped with events
        unsent."""
        with self._cond:
            target = self._queued
        self._wake()
        with self._cond:
            self._cond.wait_for(lambda: self._sent >= target or self._dead, timeout)
            return self._sent >= target

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        with self._cond:
            already = self._closing
            self._closing = True
        if not already:
            self._wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._wake_r.close()
            self._wake_w.close()

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                ready = dict(poller.poll(self._interval_ms))
                self.wakeups += 1
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                if self._wake_r.fileno() in ready:  # a plain socket is reported by its fd
                    self._drain_wake()
                with self._cond:
                    items, self._pending = self._pending, []
                    closing = self._closing
                self._publish_items(encoder, items)
                if closing:
                    with self._cond:
                        if not self._pending:
                            break
        except Exception:
            _logger.exception("KV event publisher thread failed; no more events are sent")
        finally:
            close_sockets((self._pub, self._replay), linger=None)
            with self._cond:
                self._dead = True
                self._cond.notify_all()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass

    def _publish_items(self, encoder: msgspec.msgpack.Encoder, items: list[Any]) -> None:
        """Expand deferred items and send the events in batches of at most `max_batch`."""
        events: list[Any] = []
        for item in items:
            if not callable(item):
                events.append(item)
                continue
            try:
                events += item()
            except Exception:  # a bug in a deferred item must not stop the thread
                self.errors += 1
                _logger.exception("a deferred KV event failed; dropped")
        for start in range(0, len(events), self._max_batch):
            self._publish(encoder, events[start : start + self._max_batch])
        with self._cond:  # one per queued item, however many events it made
            self._sent += len(items)
            self._cond.notify_all()

    def _publish(self, encoder: msgspec.msgpack.Encoder, events: list[Any]) -> None:
        batch = EventBatch(ts=time.time(), events=events, data_parallel_rank=self._dp_rank)
        try:
            payload = encoder.encode(batch)
        except Exception:  # a bug here must not stop the thread: drop the batch, say so
            self.errors += 1
            _logger.exception("KV event batch of %d events not encoded; dropped", len(events))
            return
        seq = self._next_seq
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            self.errors += 1
            _logger.exception("KV event batch %d not sent (still kept for replay)", seq)
        self._buffer.append((seq, payload))
        with self._cond:
            self._next_seq = seq + 1
            self.published_batches += 1

    def _serve_replay(self) -> None:
        """Answer every waiting replay request (`answer_replay`); count the malformed."""
        replay = self._replay
        assert replay is not None
        while (answered := answer_replay(replay, self._buffer)) is not None:
            if not answered:
                self.errors += 1
