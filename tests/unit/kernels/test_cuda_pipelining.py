"""CUDA streams enqueue job N+1 while job N's copies still run, and report completions in
submission order. Checked without a GPU: the cuda-python calls, the engine and the copy
functions are stand-ins that record what they get (tests/gpu moves real bytes)."""

from __future__ import annotations

import contextlib
import gc
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hicache.kernels import MHAGeometry
from hicache.kernels.streams import cuda as cuda_streams

G = MHAGeometry(layers=3, heads=1, head_dim=8, dtype=torch.float16)
WAIT_S = 10.0  # a bound on every wait: a stream that fails to pipeline fails, never hangs


class FakeCuda:
    """The runtime calls `CudaStreams` makes. `synchronize` blocks on `gate` the first time it
    is called, as a host wait on a copy still running on the GPU would."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.synchronizing = threading.Event()
        self._events = 0
        self._first = True
        self.destroyed: list[int] = []
        self.destroyed_streams: list[int] = []
        self.synchronized: list[int] = []
        self.waits: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def stream(self) -> int:
        return 7

    def event(self) -> int:
        with self._lock:
            self._events += 1
            return self._events

    def record(self, event, stream) -> None:
        pass

    def stream_wait(self, stream, event) -> None:
        self.waits.append((stream, event))

    def synchronize(self, event) -> None:
        with self._lock:
            first, self._first = self._first, False
            self.synchronized.append(event)
        if first:
            self.synchronizing.set()
            assert self.gate.wait(WAIT_S), "the test never released the first copy"

    def query(self, event) -> bool:
        return True

    def destroy_events(self, events) -> None:
        with self._lock:
            self.destroyed.extend(events)

    def destroy_stream(self, stream) -> None:
        self.destroyed_streams.append(stream)


@pytest.fixture
def streams(monkeypatch):
    fake = FakeCuda()
    calls = Copies()

    def copied(kind):
        def copy(*args):
            calls.add(kind)

        return copy

    monkeypatch.setattr(cuda_streams, "_Cuda", lambda: fake)
    monkeypatch.setattr(cuda_streams, "CudaEngine", lambda *a, **k: SimpleNamespace())
    monkeypatch.setattr(cuda_streams, "plan_transfer", lambda *a: "plan")
    monkeypatch.setattr(cuda_streams, "run_backup", copied("backup"))
    monkeypatch.setattr(cuda_streams, "run_load_all", copied("load"))
    monkeypatch.setattr(cuda_streams, "run_load_layer", copied("layer"))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda *a, **k: None)

    def current_stream(device=None):
        # a stream per device, as torch has; None is the current device, cuda:0 here
        index = 0 if device is None else torch.device(device).index
        return SimpleNamespace(cuda_stream=100 + index)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    device_pool = SimpleNamespace(device=torch.device("cuda:1"), geometry=G)
    s = cuda_streams.CudaStreams(device_pool, SimpleNamespace(), io="kernel")  # type: ignore[arg-type]
    yield s, fake, calls
    fake.gate.set()
    s.close()


class Copies:
    """The copies enqueued, in order; `fail_at` makes that one (1-based) raise."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.fail_at: int | None = None
        self._cond = threading.Condition()

    def add(self, kind: str) -> None:
        with self._cond:
            self.kinds.append(kind)
            self._cond.notify_all()
            if len(self.kinds) == self.fail_at:
                raise RuntimeError("copy refused")

    def reach(self, count: int) -> bool:
        """Whether `count` copies are enqueued within WAIT_S."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.kinds) >= count, timeout=WAIT_S)


def reporter():
    done: list[object] = []
    both = threading.Event()

    def on_done(index):
        def report(error):
            done.append((index, error))
            if len(done) == 2:
                both.set()

        return report

    return done, both, on_done


SLOTS = np.arange(4, dtype=np.int64)


def test_a_backup_is_enqueued_while_the_one_before_still_copies(streams):
    s, fake, calls = streams
    done, both, on_done = reporter()
    s.submit_backup(SLOTS, SLOTS, on_done=on_done(0))
    assert fake.synchronizing.wait(WAIT_S)  # job 0's completion waits on its copy
    s.submit_backup(SLOTS, SLOTS, on_done=on_done(1))
    assert calls.reach(2), "job 1 waited for job 0's copy to finish"
    assert done == []  # nothing reported while job 0 still copies
    fake.gate.set()
    assert both.wait(WAIT_S)
    assert done == [(0, None), (1, None)]


def test_a_failed_enqueue_is_reported_in_order(streams):
    s, fake, calls = streams
    calls.fail_at = 2  # the second backup's copy is refused
    done, both, on_done = reporter()
    s.submit_backup(SLOTS, SLOTS, on_done=on_done(0))
    assert fake.synchronizing.wait(WAIT_S)
    s.submit_backup(SLOTS, SLOTS, on_done=on_done(1))
    fake.gate.set()
    assert both.wait(WAIT_S)
    assert [i for i, _ in done] == [0, 1]  # the failure waits for the job before it
    assert done[0][1] is None
    assert isinstance(done[1][1], RuntimeError)


def test_a_load_is_enqueued_while_the_one_before_still_copies(streams):
    s, fake, calls = streams
    done, both, on_done = reporter()
    first = s.submit_load(SLOTS, SLOTS, on_done=on_done(0))
    assert fake.synchronizing.wait(WAIT_S)
    assert first.enqueued.landed(G.layers - 1)  # every layer enqueued, none waited for
    assert not first.done()
    second = s.submit_load(SLOTS, SLOTS, on_done=on_done(1))
    assert calls.reach(2 * G.layers), "load 1 waited for load 0's copy to finish"
    assert calls.kinds == ["layer"] * (2 * G.layers)
    fake.gate.set()
    assert both.wait(WAIT_S)
    assert done == [(0, None), (1, None)]
    assert first.done() and second.done()


def test_close_lets_jobs_report_then_releases_both_streams_once(streams):
    s, fake, _calls = streams
    done, both, on_done = reporter()
    s.submit_backup(SLOTS, SLOTS, on_done=on_done(0))
    s.submit_load(SLOTS, SLOTS, on_done=on_done(1))
    fake.gate.set()
    s.close()
    assert both.is_set() and sorted(i for i, _ in done) == [0, 1]
    assert fake.destroyed_streams == [7, 7]  # the load stream and the backup stream
    s.close()
    assert fake.destroyed_streams == [7, 7]
    for submit in (s.submit_backup, s.submit_load):
        first = fake._events + 1
        with pytest.raises(RuntimeError, match="closed"):
            submit(SLOTS, SLOTS, on_done=on_done(2))
        gc.collect()  # a refused load's handle, and its layer events, are gone
        made = set(range(first, fake._events + 1))
        assert made and made <= set(fake.destroyed)  # every event the refused job made


@pytest.mark.parametrize("direction", ["load", "backup"])
def test_a_failed_job_is_reported_after_the_copies_it_enqueued(streams, direction):
    """The tree frees (and reuses) a failed transfer's slots once it hears of the failure:
    the copies the job enqueued before failing must have run by then."""
    s, fake, calls = streams
    calls.fail_at = 2 if direction == "load" else 1  # a load's second layer; the backup's copy
    reported = threading.Event()
    errors: list[object] = []

    def on_done(error):
        errors.append(error)
        reported.set()

    submit = s.submit_load if direction == "load" else s.submit_backup
    submit(SLOTS, SLOTS, on_done=on_done)
    assert fake.synchronizing.wait(WAIT_S), "reported without waiting for the stream"
    assert not reported.is_set()
    fake.gate.set()
    assert reported.wait(WAIT_S)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)


def test_a_failed_inline_copy_raises_after_what_it_enqueued_has_run(streams):
    _s, fake, calls = streams
    fake.gate.set()
    calls.fail_at = 1
    device_pool = SimpleNamespace(device=torch.device("cuda:0"), geometry=G)
    inline = cuda_streams.CudaInlineCopies(device_pool, SimpleNamespace(), "kernel")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="copy refused"):
        inline.load_all("plan")  # type: ignore[arg-type]
    assert len(fake.synchronized) == 1  # the stream was waited for before the error went up
    inline.close()


def test_waiting_for_a_layer_orders_the_pools_device_stream(streams):
    """The pool is on cuda:1 while the caller's current device is cuda:0: the wait must order
    cuda:1's current stream (the one whose kernels read the layer), not cuda:0's."""
    s, fake, _calls = streams
    fake.gate.set()
    handle = s.submit_load(SLOTS, SLOTS, on_done=lambda error: None)
    handle.wait(1)
    assert fake.waits[-1] == (101, handle.events[1])
