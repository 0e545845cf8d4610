"""The hf3fs backend over a stand-in for 3FS's usrbio API (usrbio_standin.py: ordinary files,
every call recorded): the conformance kit, and what is its own (the spec, one submission per
batch through the iov, files shared with the file store, a verified value before the host
pool is touched, lanes retired after a stall and released at close)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache.backends.file import FileBackend
from hicache.backends.hf3fs import Hf3fsBackend, Hf3fsSpec
from hicache.backends.keys import Namespace
from hicache.backends.registry import connect_backend, resolve
from hicache.testing.conformance import BackendConformance, Pages, namespace, page_keys

from .harness import Events, ValueFileHarness
from .usrbio_standin import UsrbioStandIn


class Hf3fsHarness(ValueFileHarness):
    stall_grace = 3.0  # the spec's 1 s timeout, plus the thread's return

    def __init__(self, mount: Path, **options: Any) -> None:
        self.mount = mount
        self.root = mount / "kv"
        self.usrbio = UsrbioStandIn(str(mount))
        self.options = {"timeout": 1.0, **options}

    def open(self, ns: Namespace, emit: Any) -> Hf3fsBackend:
        return Hf3fsBackend.from_spec(
            f"hf3fs:{self.root}", namespace=ns, emit=emit, usrbio=self.usrbio, **self.options
        )

    def stall(self) -> Any:
        return self.usrbio.stall()


class TestHf3fsConformance(BackendConformance):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> Hf3fsHarness:
        return Hf3fsHarness(tmp_path)


class TestHf3fsSmallIovConformance(BackendConformance):
    """An iov of 1 MiB and rings of 3 entries: every batch of the kit goes in rounds."""

    @pytest.fixture
    def harness(self, tmp_path: Path) -> Hf3fsHarness:
        return Hf3fsHarness(tmp_path, iov_mb=1, entries=3)


def test_spec_options_and_errors() -> None:
    spec = Hf3fsSpec.parse("hf3fs:/3fs/kv?threads=4&timeout=2.5&fsync=yes&entries=8&iov_mb=16")
    assert (spec.root, spec.threads, spec.timeout, spec.fsync, spec.entries, spec.iov_mb) == (
        "/3fs/kv",
        4,
        2.5,
        True,
        8,
        16,
    )
    assert Hf3fsSpec.parse("hf3fs:/d", mount="/3fs").mount == "/3fs"
    for bad, match in [
        ("hf3fs:", "needs a directory"),
        ("hf3fs:/d?threads=0", "threads"),
        ("hf3fs:/d?threads=1.5", "threads must be an integer"),
        ("hf3fs:/d?timeout=0", "timeout"),
        ("hf3fs:/d?fsync=maybe", "fsync"),
        ("hf3fs:/d?iov=2", "unknown option 'iov'"),
    ]:
        with pytest.raises(ValueError, match=match):
            Hf3fsSpec.parse(bad)
    with pytest.raises(TypeError, match="unknown hf3fs backend options"):
        Hf3fsSpec.parse("hf3fs:/d", bogus=1)
    assert resolve("hf3fs:/d") == "hicache.backends.hf3fs:Hf3fsBackend"
    with pytest.raises(ValueError, match="needs a directory"):
        Hf3fsSpec.parse("hf3fs:")


@pytest.mark.anyio
async def test_a_batch_is_one_submission_through_the_iov(tmp_path: Path) -> None:
    harness = Hf3fsHarness(tmp_path)
    ns = namespace("batch")
    keys = page_keys(ns, 6)
    src = Pages(6).fill(3)
    backend = harness.open(ns, Events())
    assert await backend.set_from(keys, src.buffers(range(6))) == 6
    usrbio = harness.usrbio
    assert usrbio.count("submit") == 1 and usrbio.count("prepare") == 6
    assert usrbio.registered == set()  # every fd deregistered after its batch
    usrbio.calls.clear()
    dst = Pages(6)
    assert await backend.get_into(keys, dst.buffers(range(6))) == 6
    assert np.array_equal(src.data, dst.data)
    assert usrbio.count("submit") == 1 and usrbio.count("prepare") == 6
    assert usrbio.count("make_iovec") == 0  # the lane is reused
    assert backend.stats()["lanes"] == 1
    await backend.aclose()
    assert backend.stats()["lanes"] == 0
    gc.collect()
    assert len(usrbio.live) == 0  # rings and iovs dropped at close


@pytest.mark.anyio
async def test_values_read_the_same_through_the_file_store(tmp_path: Path) -> None:
    harness = Hf3fsHarness(tmp_path)
    ns = namespace("shared")
    keys = page_keys(ns, 4)
    src = Pages(4).fill(1)
    hf3fs = harness.open(ns, Events())
    assert await hf3fs.set_from(keys, src.buffers(range(4))) == 4
    files = FileBackend(harness.root, namespace=ns, threads=0)
    dst = Pages(4)
    assert await files.get_into(keys, dst.buffers(range(4))) == 4
    assert np.array_equal(src.data, dst.data)
    other = page_keys(ns, 2, start=500)
    assert await files.set_from(other, src.buffers(range(2))) == 2
    assert await hf3fs.get_into(other, dst.buffers(range(2))) == 2
    await hf3fs.aclose()
    await files.aclose()


@pytest.mark.anyio
async def test_a_corrupt_value_never_touches_the_host_pages(tmp_path: Path) -> None:
    harness = Hf3fsHarness(tmp_path)
    ns = namespace("verify")
    keys = page_keys(ns, 3)
    src = Pages(3).fill(4)
    events = Events()
    backend = harness.open(ns, events)
    assert await backend.set_from(keys, src.buffers(range(3))) == 3
    raw = harness.read_raw(keys[1])
    assert raw is not None
    harness.write_raw(keys[1], raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    dst = Pages(3)
    dst.data[:] = 7
    assert await backend.get_into(keys, dst.buffers(range(3))) == 1
    assert dst.page_bytes(0) == src.page_bytes(0)
    assert set(dst.page_bytes(1)) == {7}  # verified in the iov, so never copied out
    assert [e["reason"] for e in events.named("storage.corrupt")] == ["checksum"]
    assert harness.read_raw(keys[1]) is None
    await backend.aclose()


@pytest.mark.anyio
async def test_a_torn_write_is_not_stored(tmp_path: Path) -> None:
    harness = Hf3fsHarness(tmp_path)
    ns = namespace("torn")
    keys = page_keys(ns, 3)
    events = Events()
    backend = harness.open(ns, events)
    harness.usrbio.writes_short_by = 5
    assert await backend.set_from(keys, Pages(3).fill(5).buffers(range(3))) == 0
    assert "moved" in events.named("storage.error")[0]["error"]
    assert await backend.exists(keys) == 0
    assert list((harness.root / ns.digest / "tmp").iterdir()) == []  # no temporary left
    await backend.aclose()


@pytest.mark.anyio
async def test_a_page_usrbio_refuses_ends_the_batch_and_leaves_the_ring_empty(
    tmp_path: Path,
) -> None:
    harness = Hf3fsHarness(tmp_path, threads=1)
    ns = namespace("refused")
    keys = page_keys(ns, 6)
    src = Pages(6).fill(8)
    events = Events()
    backend = harness.open(ns, events)
    harness.usrbio.refuse_fds_after = 2
    assert await backend.set_from(keys[:4], src.buffers(range(4))) == 2  # the two prepared
    assert "too many registered fds" in events.named("storage.error")[0]["error"]
    rings = [r() for r in harness.usrbio.rings]
    assert all(not r.prepared and not r.submitted for r in rings if r is not None)
    harness.usrbio.refuse_fds_after = None
    assert await backend.set_from(keys[2:], src.buffers(range(2, 6))) == 4
    dst = Pages(6)
    assert await backend.get_into(keys, dst.buffers(range(6))) == 6
    assert np.array_equal(src.data, dst.data)
    assert harness.usrbio.registered == set()
    await backend.aclose()


@pytest.mark.anyio
async def test_a_stalled_lane_is_retired_and_replaced(tmp_path: Path) -> None:
    harness = Hf3fsHarness(tmp_path, timeout=0.2, threads=1)
    ns = namespace("stall")
    keys = page_keys(ns, 2)
    src = Pages(2).fill(6)
    events = Events()
    backend = harness.open(ns, events)
    assert await backend.set_from(keys, src.buffers(range(2))) == 2
    with harness.usrbio.stall():
        assert await backend.get_into(keys, Pages(2).buffers(range(2))) == 0
    assert "done after 0.2s" in events.named("storage.error")[0]["error"]
    assert backend.stats()["lanes"] == 0  # the stalled lane's iov may still be written
    dst = Pages(2)
    assert await backend.get_into(keys, dst.buffers(range(2))) == 2
    assert np.array_equal(src.data, dst.data)
    assert harness.usrbio.count("make_iovec") == 2
    await backend.aclose()


@pytest.mark.anyio
async def test_a_page_larger_than_the_iov_is_an_error_naming_the_option(tmp_path: Path) -> None:
    harness = Hf3fsHarness(tmp_path, iov_mb=1)
    ns = namespace("big")
    events = Events()
    backend = harness.open(ns, events)
    big = [[memoryview(np.zeros(2 << 20, dtype=np.uint8))]]
    assert await backend.set_from(page_keys(ns, 1), big) == 0
    assert "iov_mb" in events.named("storage.error")[0]["error"]
    await backend.aclose()


@pytest.mark.anyio
async def test_the_registry_opens_it_and_a_missing_usrbio_fails_the_open(tmp_path: Path) -> None:
    from hicache.backends.base import BackendUnavailable
    from hicache.backends.hf3fs import usrbio_missing

    ns = namespace("registry")
    usrbio = UsrbioStandIn(str(tmp_path))
    backend = await connect_backend(f"hf3fs:{tmp_path}/kv", namespace=ns, usrbio=usrbio)
    assert await backend.set_from(page_keys(ns, 1), Pages(1).fill(1).buffers(range(1))) == 1
    await backend.aclose()
    if usrbio_missing() is None:
        pytest.skip("hf3fs_fuse is installed here")
    with pytest.raises(BackendUnavailable, match="hf3fs-py-usrbio"):
        await connect_backend(f"hf3fs:{tmp_path}/kv", namespace=ns)
