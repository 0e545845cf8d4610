"""The NIXL backend over the real NIXL library (POSIX plugin): the conformance kit, and what is
its own (spec parsing, files shared with the file store, registered host memory)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache.backends import nixl
from hicache.backends.base import BackendUnavailable
from hicache.backends.file import FileBackend
from hicache.backends.file import native as native_module
from hicache.backends.keys import Namespace
from hicache.backends.nixl import NixlBackend, NixlSpec, nixl_missing
from hicache.backends.registry import connect_backend
from hicache.testing.conformance import BackendConformance, Pages, namespace, page_keys
from tests.unit.backends.harness import ValueFileHarness

pytestmark = pytest.mark.nixl
if nixl_missing() is not None:  # one line in the summary, not one per test
    pytest.skip(str(nixl_missing()), allow_module_level=True)


class NixlHarness(ValueFileHarness):
    def __init__(self, root: Path, **options: Any) -> None:
        self.root = root
        self.options = options

    def open(self, ns: Namespace, emit: Any) -> NixlBackend:
        return NixlBackend.from_spec(f"nixl:{self.root}", namespace=ns, emit=emit, **self.options)


class TestNixlConformance(BackendConformance):
    @pytest.fixture
    def harness(self, tmp_path: Path) -> NixlHarness:
        return NixlHarness(tmp_path / "store")


class TestNixlUringConformance(BackendConformance):
    """The same over io_uring (the POSIX plugin's `use_uring`), where the kernel allows it."""

    @pytest.fixture
    def harness(self, tmp_path: Path) -> NixlHarness:
        return NixlHarness(tmp_path / "store", params={"use_uring": "true"})


def test_spec_options_and_errors() -> None:
    spec = NixlSpec.parse("nixl:/data/kv?threads=4&timeout=2.5&fsync=yes&param.use_uring=true")
    assert (spec.root, spec.plugin, spec.threads, spec.timeout, spec.fsync) == (
        "/data/kv",
        "POSIX",
        4,
        2.5,
        True,
    )
    assert spec.params == (("use_uring", "true"),)
    assert NixlSpec.parse("nixl:/d").params == (("use_aio", "true"),)  # the POSIX default queue
    assert NixlSpec.parse("nixl:/d?plugin=gds_mt", threads=1).plugin == "GDS_MT"
    for bad, match in [
        ("nixl:", "needs a directory"),
        ("nixl:/d?plugin=OBJ", "not a file plugin"),
        ("nixl:/d?threads=0", "threads"),
        ("nixl:/d?timeout=-1", "timeout"),
        ("nixl:/d?fsync=maybe", "fsync"),
        ("nixl:/d?treads=2", "unknown option 'treads'"),
    ]:
        with pytest.raises(ValueError, match=match):
            NixlSpec.parse(bad)
    with pytest.raises(TypeError, match="unknown nixl backend options"):
        NixlSpec.parse("nixl:/d", bogus=1)


@pytest.mark.anyio
async def test_values_read_the_same_through_the_file_store(tmp_path: Path) -> None:
    ns = namespace("shared")
    keys = page_keys(ns, 4)
    src = Pages(4).fill(1)
    nixl = await connect_backend(f"nixl:{tmp_path}", namespace=ns)
    assert await nixl.set_from(keys, src.buffers(range(4))) == 4
    files = FileBackend(tmp_path, namespace=ns, threads=0)
    dst = Pages(4)
    assert await files.get_into(keys, dst.buffers(range(4))) == 4
    assert np.array_equal(src.data, dst.data)
    other = page_keys(ns, 2, start=500)
    assert await files.set_from(other, src.buffers(range(2))) == 2
    assert await nixl.get_into(other, dst.buffers(range(2))) == 2
    assert dst.page_bytes(1) == src.page_bytes(1)
    await nixl.aclose()
    await files.aclose()


@pytest.mark.anyio
async def test_registered_host_memory_moves_without_per_batch_registration(
    tmp_path: Path,
) -> None:
    ns = namespace("registered")
    keys = page_keys(ns, 8)
    pool = np.random.default_rng(2).integers(0, 256, (8, 1024), dtype=np.uint8)
    backend = NixlBackend.from_spec(f"nixl:{tmp_path}", namespace=ns)
    backend.register_host_memory(pool.ctypes.data, pool.nbytes)
    assert await backend.set_from(keys, [[memoryview(row)] for row in pool]) == 8
    copy = pool.copy()
    pool[:] = 0
    assert await backend.get_into(keys, [[memoryview(row)] for row in pool]) == 8
    assert np.array_equal(pool, copy)
    assert backend.stats()["bytes_read"] == pool.nbytes
    await backend.aclose()


@pytest.mark.anyio
async def test_a_plugin_that_cannot_start_fails_the_open(tmp_path: Path) -> None:
    ns = namespace("gds")
    # GDS needs cuFile and a GPU; where it does start, this test has nothing to show.
    try:
        backend = await connect_backend(f"nixl:{tmp_path}?plugin=GDS", namespace=ns)
    except BackendUnavailable as exc:
        assert "GDS" in str(exc) and str(tmp_path) in str(exc)
    else:
        await backend.aclose()
        pytest.skip("the GDS plugin starts here")


@pytest.mark.anyio
async def test_header_slabs_are_reused_bounded_and_freed_at_close(tmp_path: Path) -> None:
    ns = namespace("slabs")
    keys = page_keys(ns, 80)
    src = Pages(80).fill(3)
    backend = NixlBackend.from_spec(f"nixl:{tmp_path}?threads=2", namespace=ns)
    assert await backend.set_from(keys, src.buffers(range(80))) == 80
    dst = Pages(80)
    for _ in range(3):
        assert await backend.get_into(keys[:4], dst.buffers(range(4))) == 4
    assert len(backend._header_slabs) == 1  # one batch at a time: one slab, reused
    small = backend._header_slabs[0][0].nbytes
    # more headers than the slab holds: it is replaced by a larger one, not kept beside it
    assert await backend.get_into(keys, dst.buffers(range(80))) == 80
    assert np.array_equal(src.data, dst.data)
    assert [slab.nbytes > small for slab, _ in backend._header_slabs] == [True]
    await backend.aclose()
    assert backend._header_slabs == []


def _eight_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> tuple[NixlBackend, list[str], Pages, list[tuple[str, dict[str, Any]]]]:
    """A backend recording its events, 8 keys and 8 filled pages; without the compiled module
    where `native` is false (skipped where it is wanted and cannot be built)."""
    if not native:
        monkeypatch.setattr(native_module, "native_file_io", lambda: None)
    elif native_module.native_file_io() is None:
        pytest.skip(f"compiled file I/O not built: {native_module.unavailable_reason()}")
    ns = namespace("parts")
    events: list[tuple[str, dict[str, Any]]] = []
    backend = NixlBackend.from_spec(
        f"nixl:{tmp_path}", namespace=ns, emit=lambda name, **f: events.append((name, f))
    )
    return backend, page_keys(ns, 8), Pages(8).fill(4), events


@pytest.mark.anyio
@pytest.mark.parametrize("native", [True, False], ids=["compiled-checksums", "per-piece"])
async def test_a_read_moves_in_parts_and_a_failed_part_keeps_the_verified_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """With the compiled checksums a batch is read in TRANSFER_PARTS transfers (each part's
    checksums beside the next part's transfer); a part that fails ends the hits there, the
    parts before it verified and kept, and is a `storage.error`. Without them: one transfer."""
    backend, keys, src, events = _eight_pages(tmp_path, monkeypatch, native)
    assert await backend.set_from(keys, src.buffers(range(8))) == 8
    moves: list[int] = []
    real_move = NixlBackend._move

    def counted(self: NixlBackend, agent: Any, op: str, local: Any, *rest: Any) -> str | None:
        moves.append(len(local))
        return real_move(self, agent, op, local, *rest)

    monkeypatch.setattr(NixlBackend, "_move", counted)
    dst = Pages(8)
    assert await backend.get_into(keys, dst.buffers(range(8))) == 8
    assert np.array_equal(src.data, dst.data)
    parts = nixl.TRANSFER_PARTS if native else 1
    assert len(moves) == parts  # each move: its pages' headers and 4 pieces each
    assert sum(moves) == 8 * 5

    calls = 0

    def second_fails(self: NixlBackend, *args: Any) -> str | None:
        nonlocal calls
        calls += 1
        return "injected failure" if calls == 2 else real_move(self, *args)

    monkeypatch.setattr(NixlBackend, "_move", second_fails)
    dst = Pages(8)
    got = await backend.get_into(keys, dst.buffers(range(8)))
    first = nixl._parts(8, parts)[0][1] if parts > 1 else 8  # the part before the failed one
    assert got == first
    assert np.array_equal(src.data[:, :, :got], dst.data[:, :, :got])
    errors = [f for name, f in events if name == "storage.error"]
    assert [e["error"] for e in errors] == (["injected failure"] if parts > 1 else [])
    assert not [name for name, _ in events if name == "storage.corrupt"]
    await backend.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("native", [True, False], ids=["compiled-checksums", "per-piece"])
async def test_a_write_moves_in_parts_and_a_failed_part_keeps_the_placed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """Writes move in the same parts; each landed page gets its header and is placed, so a
    part that fails stores the pages before it (a `storage.error`), leaves no temporary file,
    and what was stored reads back whole."""
    backend, keys, src, events = _eight_pages(tmp_path, monkeypatch, native)
    real_move = NixlBackend._move
    moves: list[int] = []

    def second_fails(self: NixlBackend, agent: Any, op: str, local: Any, *rest: Any) -> str | None:
        moves.append(len(local))
        if len(moves) == 2:
            return "injected failure"
        return real_move(self, agent, op, local, *rest)

    monkeypatch.setattr(NixlBackend, "_move", second_fails)
    stored = await backend.set_from(keys, src.buffers(range(8)))
    parts = nixl.TRANSFER_PARTS if native else 1
    first = nixl._parts(8, parts)[0][1] if parts > 1 else 8
    if parts > 1:
        assert len(moves) == 2 and stored == first
        errors = [f for name, f in events if name == "storage.error"]
        assert [(e["op"], e["key"], e["error"]) for e in errors] == [
            ("set", keys[first], "injected failure")
        ]
    else:  # one transfer, the second call never comes
        assert len(moves) == 1 and stored == 8
    monkeypatch.setattr(NixlBackend, "_move", real_move)
    assert await backend.exists(keys) == stored
    dst = Pages(8)
    assert await backend.get_into(keys, dst.buffers(range(8))) == stored
    assert np.array_equal(src.data[:, :, :stored], dst.data[:, :, :stored])
    assert list((tmp_path / backend.namespace.digest / "tmp").iterdir()) == []
    assert not [name for name, _ in events if name == "storage.corrupt"]
    await backend.aclose()


def test_parts_cover_the_batch_in_order_none_empty_the_last_shortest() -> None:
    for n in range(1, 70):
        for parts in range(1, 7):
            runs = nixl._parts(n, parts)
            assert runs[0][0] == 0 and runs[-1][1] == n
            assert all(lo < hi for lo, hi in runs)
            assert all(a[1] == b[0] for a, b in itertools.pairwise(runs))
            assert len(runs) == min(n, parts)
            sizes = [hi - lo for lo, hi in runs]
            assert sizes[-1] <= min(sizes), (n, parts, sizes)
