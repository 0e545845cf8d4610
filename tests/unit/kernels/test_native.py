"""The compiled row copier (kernels/native/rowcopy.py, rowcopy.c), its fallbacks, and huge-page
pool memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.kernels import DevicePool, HostPool, MHAGeometry, backup, load_layer
from hicache.kernels.engines import CpuEngine
from hicache.kernels.huge_pages import HUGE_PAGE
from hicache.kernels.native.rowcopy import native_rows, unavailable_reason
from hicache.kernels.pinning import cpu_bytes
from tests.unit.kernels.reference import randomize

ROOT = Path(__file__).resolve().parents[3]

needs_native = pytest.mark.skipif(
    native_rows() is None, reason=f"compiled row copier unavailable: {unavailable_reason()}"
)


def _expected(dst, src, dst_rows, src_rows):
    out = dst.copy()
    out[dst_rows] = src[src_rows]
    return out


@needs_native
@pytest.mark.parametrize("seed", range(24))
def test_random_pair_lists_match_numpy(seed):
    """Row lengths around the copier's 64-byte steps and 16-byte store alignment, streaming or
    not, tables or consecutive runs on either side: the same bytes as numpy fancy indexing."""
    rng = np.random.default_rng(seed)
    row_bytes = int(rng.choice([1, 3, 12, 63, 64, 65, 200, 256, 2048, 4100]))
    dst_count, src_count = int(rng.integers(4, 300)), int(rng.integers(4, 300))
    n = int(rng.integers(1, min(dst_count, src_count) + 1))
    # an odd byte offset into a larger buffer makes some destinations unaligned for streaming
    skew = int(rng.integers(0, 16))
    backing = rng.integers(0, 256, size=dst_count * row_bytes + skew, dtype=np.uint8)
    dst = backing[skew:].reshape(dst_count, row_bytes)
    src = rng.integers(0, 256, size=(src_count, row_bytes), dtype=np.uint8)
    dst_rows = rng.permutation(dst_count)[:n].astype(np.int64)
    src_rows = rng.integers(0, src_count, size=n).astype(np.int64)  # sources may repeat
    table_side = int(rng.integers(0, 3))  # 0: both tables, 1: consecutive dst, 2: consecutive src
    if table_side == 1:
        first = int(rng.integers(0, dst_count - n + 1))
        expected = _expected(dst, src, np.arange(first, first + n), src_rows)
        native_rows().copy(dst, src, None, first, src_rows, 0, n, streaming=bool(seed % 2))
    elif table_side == 2:
        first = int(rng.integers(0, src_count - n + 1))
        expected = _expected(dst, src, dst_rows, np.arange(first, first + n))
        native_rows().copy(dst, src, dst_rows, 0, None, first, n, streaming=bool(seed % 2))
    else:
        expected = _expected(dst, src, dst_rows, src_rows)
        native_rows().copy(dst, src, dst_rows, 0, src_rows, 0, n, streaming=bool(seed % 2))
    assert np.array_equal(dst, expected)


@needs_native
def test_out_of_range_rows_are_refused_without_touching_other_memory():
    backing = np.zeros((6, 32), dtype=np.uint8)
    dst = backing[:4]  # rows 4 and 5 lie beyond the destination the copier is given
    src = np.full((4, 32), 7, dtype=np.uint8)
    with pytest.raises(IndexError, match="1 of 3 row pairs out of range"):
        native_rows().copy(
            dst,
            src,
            np.array([0, 4, 2], dtype=np.int64),
            0,
            np.array([1, 2, 3], dtype=np.int64),
            0,
            3,
            streaming=False,
        )
    assert backing[0].tolist() == [7] * 32 and backing[2].tolist() == [7] * 32
    assert not backing[[1, 3, 4, 5]].any()
    with pytest.raises(IndexError):  # a negative source row, a consecutive run past the end
        native_rows().copy(
            dst, src, None, 3, np.array([-1, 0], dtype=np.int64), 0, 2, streaming=False
        )
    assert not backing[4:].any()


@needs_native
@pytest.mark.parametrize(
    "bad",
    [
        np.array([0, 1], dtype=np.int32),
        np.array([[0, 1]], dtype=np.int64),
        np.array([0], dtype=np.int64),
    ],
)
def test_malformed_row_tables_are_refused(bad):
    dst, src = np.zeros((4, 8), dtype=np.uint8), np.ones((4, 8), dtype=np.uint8)
    with pytest.raises(ValueError, match="row table"):
        native_rows().copy(dst, src, bad, 0, None, 0, 2, streaming=False)
    assert not dst.any()


@needs_native
def test_row_lengths_must_agree():
    with pytest.raises(ValueError, match="row lengths differ"):
        native_rows().copy(
            np.zeros((2, 8), np.uint8),
            np.zeros((2, 4), np.uint8),
            None,
            0,
            None,
            0,
            1,
            streaming=False,
        )


@needs_native
@pytest.mark.parametrize("layout", ["page_first", "page_head", "layer_first"])
def test_streamed_moves_match_numpy_rows(layout):
    """Moves past the streaming threshold (non-temporal stores, split over threads) against the
    numpy copier on identical pools."""
    g = MHAGeometry(layers=4, heads=2, head_dim=64, dtype=torch.float16)  # 2 KiB per token
    tokens, ps = 4096, 16  # 8 MiB per backup: streamed
    pools = []
    for _ in range(2):
        device = DevicePool.allocate(g, tokens, ps)
        host = HostPool(device, 2 * tokens, layout)
        randomize(device, np.random.default_rng(1))
        randomize(host.buffer, np.random.default_rng(2))
        pools.append((device, host))
    original = [
        [pools[0][0].buffer(l, c).clone().view(torch.uint8) for c in range(2)]
        for l in range(g.layers)
    ]
    rng = np.random.default_rng(3)
    pages = rng.permutation(2 * tokens // ps)[: tokens // ps]
    host_slots = (pages[:, None] * ps + np.arange(ps)).ravel()
    device_slots = (rng.permutation(tokens // ps)[:, None] * ps + np.arange(ps)).ravel()
    for (device, host), engine in zip(
        pools, (CpuEngine(native=True, threads=2), CpuEngine(native=False))
    ):
        backup(device, host, device_slots, host_slots, engine=engine)
        for layer in range(g.layers):
            device.buffer(layer, 0).zero_()
            load_layer(host, device, host_slots, device_slots, layer, engine=engine)
    (dev_a, host_a), (dev_b, host_b) = pools
    assert torch.equal(host_a.buffer, host_b.buffer)
    assert all(
        torch.equal(
            dev_a.buffer(l, c).view(torch.uint8), dev_b.buffer(l, c).view(torch.uint8)
        )  # bytes: NaNs
        for l in range(g.layers)
        for c in range(2)
    )
    assert all(
        torch.equal(dev_a.buffer(l, c).view(torch.uint8), original[l][c])
        for l in range(g.layers)
        for c in range(2)
    )


def _with_root(pythonpath: str | None) -> str:
    """This checkout first, then the caller's own path (packages installed beside it, e.g.
    wheels unpacked into a target dir on a machine with no network)."""
    return os.pathsep.join([str(ROOT), *([pythonpath] if pythonpath else [])])


def test_subprocesses_keep_the_callers_python_path():
    assert _with_root(None) == str(ROOT)
    assert _with_root(f"/opt/a{os.pathsep}/opt/b").split(os.pathsep) == [
        str(ROOT),
        "/opt/a",
        "/opt/b",
    ]


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": _with_root(os.environ.get("PYTHONPATH")), **env},
        check=False,
    )


_FALLBACK_PROBE = """
import numpy as np, torch
from hicache.kernels import DevicePool, HostPool, MHAGeometry, backup
from hicache.kernels.engines import CpuEngine
from hicache.kernels.native.rowcopy import native_rows, unavailable_reason
assert native_rows() is None
print("reason:", unavailable_reason())
try:
    CpuEngine(native=True)
except RuntimeError as exc:
    print("required:", exc)
engine = CpuEngine()
assert engine.native is None and engine.threads == 1
g = MHAGeometry(layers=2, heads=1, head_dim=4, dtype=torch.float32)
device = DevicePool.allocate(g, 8, 4)
host = HostPool(device, 16, "page_first")
device.buffer(1, 1).copy_(torch.arange(32, dtype=torch.float32).view(8, 1, 4))
backup(device, host, np.arange(4, 8), np.arange(8, 12), engine=engine)
print("copied:", bool((host.buffer.view(torch.float32).view(16, 2, 2, 4)[8:12, 1, 1].flatten() == torch.arange(16, 32)).all()))
"""


def test_disabled_by_environment_falls_back_to_numpy(tmp_path):
    done = _python(_FALLBACK_PROBE, HICACHE_NATIVE="0", HICACHE_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "reason: disabled by HICACHE_NATIVE" in done.stdout
    assert "required: native row copies unavailable: disabled by HICACHE_NATIVE" in done.stdout
    assert "copied: True" in done.stdout
    assert not list(tmp_path.iterdir())  # nothing built


def test_failing_compiler_falls_back_with_its_error(tmp_path):
    done = _python(_FALLBACK_PROBE, CC="false", HICACHE_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "reason: OSError: false failed (1)" in done.stdout
    assert "copied: True" in done.stdout
    assert not list(tmp_path.iterdir())  # no half-written library left behind


@needs_native
def test_built_library_is_cached_per_source_and_reused(tmp_path):
    probe = "from hicache.kernels.native.rowcopy import native_rows; print(native_rows().path)"
    first = _python(probe, HICACHE_CACHE_DIR=str(tmp_path))
    assert first.returncode == 0, first.stderr
    built = Path(first.stdout.strip())
    assert built.parent == tmp_path and built.name.startswith("rowcopy-")
    stamp = built.stat().st_mtime_ns
    second = _python(probe, HICACHE_CACHE_DIR=str(tmp_path))
    assert Path(second.stdout.strip()) == built and built.stat().st_mtime_ns == stamp
    other = _python(probe, HICACHE_CACHE_DIR=str(tmp_path), CC="cc -DHICACHE_VARIANT")
    assert other.returncode == 0, other.stderr
    assert Path(other.stdout.strip()) != built  # another compiler command, another library


def test_large_cpu_buffers_are_huge_page_aligned_and_zeroed():
    big = cpu_bytes(3 * HUGE_PAGE + 5)
    assert big.numel() == 3 * HUGE_PAGE + 5 and big.dtype == torch.uint8
    assert big.data_ptr() % HUGE_PAGE == 0
    assert not big.any()
    big[-1] = 9
    assert int(big[-1]) == 9 and big.numpy().flags.writeable
    small = cpu_bytes(100)
    assert small.numel() == 100 and not small.any()


def test_library_allocated_device_pool_uses_aligned_zeroed_memory():
    g = MHAGeometry(
        layers=2, heads=8, head_dim=128, dtype=torch.bfloat16
    )  # 2 MiB per buffer at 1024 tokens
    device = DevicePool.allocate(g, 1024, 16)
    for layer in range(2):
        for comp in range(2):
            buf = device.buffer(layer, comp)
            assert (
                buf.shape == (1024, 8, 128) and buf.dtype == torch.bfloat16 and buf.is_contiguous()
            )
            assert buf.data_ptr() % HUGE_PAGE == 0 and not buf.any()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_large_cpu_buffers_are_faulted_in_at_allocation():
    """A transfer must not pay first-touch faults while serving: the pages are mapped up front."""
    before = _rss_bytes()
    buffer = cpu_bytes(64 << 20)
    assert _rss_bytes() - before >= 60 << 20
    assert not buffer.any()
