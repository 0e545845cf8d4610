"""Kernel io's Triton copy kernel (triton_copy.py), run on CPU tensors in triton's interpreter:
the bytes it moves for every layout and direction, the grid bounded by `transfer_sms`, and how
the CUDA engine picks it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.config import CacheConfig, ConfigError
from hicache.kernels import DevicePool, HostPool, MHAGeometry, MLAGeometry, plan_transfer
from hicache.kernels.cpu_engine import CpuEngine
from hicache.kernels.cuda_engine import CudaEngine
from hicache.kernels.transfer import merge_trailing, run_backup, run_load_layer

triton_copy = pytest.importorskip("hicache.kernels.triton_copy", reason="triton not installed")

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _pools(geometry, layout, page_size, tokens=32):
    device = DevicePool.allocate(geometry, tokens, page_size)
    host = HostPool(device, 2 * tokens, layout, pin_memory=False)
    return device, host


def _fill(device, geometry, seed):
    rng = np.random.default_rng(seed)
    for layer in range(geometry.layers):
        for c in range(geometry.components):
            buf = device.buffer(layer, c).view(torch.uint8)
            buf.copy_(torch.from_numpy(rng.integers(0, 256, buf.shape, dtype=np.uint8)))


def _word(host, device):
    return host.word if host.word.itemsize <= device.word.itemsize else device.word


def _slots(pages, page_size, rng, total):
    chosen = rng.choice(total, pages, replace=False)
    return (chosen[:, None] * page_size + np.arange(page_size)).ravel().astype(np.int64)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize(
    "geometry",
    [MHAGeometry(2, 2, 16, torch.float16), MLAGeometry(2, 24, 8, torch.bfloat16)],
    ids=["mha", "mla"],
)
def test_kernel_moves_the_planned_pages_in_both_directions(geometry, layout, page_size):
    if layout == "page_head" and geometry.kind == "mla":
        pytest.skip("page_head is MHA only")
    device, host = _pools(geometry, layout, page_size)
    _, reference = _pools(geometry, layout, page_size)
    _fill(device, geometry, page_size)
    rng = np.random.default_rng(3)
    pages = device.size // page_size // 2
    dev_slots = _slots(pages, page_size, rng, device.size // page_size)
    host_slots = _slots(pages, page_size, rng, host.size // page_size)
    plan = plan_transfer(host, device, host_slots, dev_slots)
    host_idx, dev_idx = plan.index_tensors(CPU)
    word = _word(host, device)

    backup_pairs = [
        merge_trailing(host.page_view(layer, c, word), device.page_view(layer, c, word))
        for layer in range(geometry.layers)
        for c in range(geometry.components)
    ]
    shape = triton_copy.move_shape(backup_pairs)
    assert shape is not None
    triton_copy.launch(shape, host_idx, dev_idx, transfer_sms=3)
    run_backup(plan, device, reference, "kernel", CpuEngine())
    assert torch.equal(host.buffer, reference.buffer)

    loaded, _ = _pools(geometry, layout, page_size)
    for layer in range(geometry.layers):
        pairs = [
            merge_trailing(loaded.page_view(layer, c, word), host.page_view(layer, c, word))
            for c in range(geometry.components)
        ]
        shape = triton_copy.move_shape(pairs)
        assert shape is not None
        triton_copy.launch(shape, dev_idx, host_idx, transfer_sms=2)
    expected, _ = _pools(geometry, layout, page_size)
    for layer in range(geometry.layers):
        run_load_layer(plan, host, expected, layer, "kernel", CpuEngine())
        for c in range(geometry.components):
            assert torch.equal(
                loaded.buffer(layer, c).view(torch.uint8),
                expected.buffer(layer, c).view(torch.uint8),
            )


class GridRecorder:
    """Wraps the kernel to record each launch's grid and constants."""

    def __init__(self, kernel):
        self.kernel, self.grids, self.meta = kernel, [], []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.grids.append(grid)
            self.meta.append(meta)
            return self.kernel[grid](*args, **meta)

        return run


@pytest.mark.parametrize(("transfer_sms", "pages"), [(1, 16), (3, 16), (8, 16), (64, 2)])
def test_grid_is_at_most_transfer_sms_programs(transfer_sms, pages, monkeypatch):
    g = MHAGeometry(2, 2, 16, torch.float16)
    device, host = _pools(g, "page_first", 1)
    _fill(device, g, 0)
    recorder = GridRecorder(triton_copy.kernel())
    monkeypatch.setattr(triton_copy, "kernel", lambda: recorder)
    slots = np.arange(pages, dtype=np.int64)
    plan = plan_transfer(host, device, slots + 32, slots)
    word = _word(host, device)
    pairs = [
        merge_trailing(host.page_view(layer, c, word), device.page_view(layer, c, word))
        for layer in range(g.layers)
        for c in range(g.components)
    ]
    shape = triton_copy.move_shape(pairs)
    host_idx, dev_idx = plan.index_tensors(CPU)
    triton_copy.launch(shape, host_idx, dev_idx, transfer_sms=transfer_sms)
    ((programs,),) = recorder.grids
    items = len(pairs) * pages * shape.dst_pieces.numel()
    groups = -(-items // recorder.meta[0]["ITEMS"])
    assert programs == min(transfer_sms, groups) and programs <= transfer_sms
    ref, _ = _pools(g, "page_first", 1)
    run_load_layer(plan, host, ref, 0, "kernel", CpuEngine())  # host really got the pages
    got, want = ref.buffer(0, 0)[:pages], device.buffer(0, 0)[:pages]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_empty_moves_launch_nothing(monkeypatch):
    g = MHAGeometry(1, 1, 16, torch.float16)
    device, host = _pools(g, "layer_first", 4)
    recorder = GridRecorder(triton_copy.kernel())
    monkeypatch.setattr(triton_copy, "kernel", lambda: recorder)
    word = _word(host, device)
    shape = triton_copy.move_shape([(host.page_view(0, 0, word), device.page_view(0, 0, word))])
    none = torch.zeros(0, dtype=torch.int64)
    triton_copy.launch(shape, none, none, transfer_sms=4)
    assert recorder.grids == []


def test_views_without_one_pattern_are_left_to_the_caller():
    a = torch.zeros(4, 8, dtype=torch.int32)
    b = torch.zeros(4, 16, dtype=torch.int32)[:, :8]  # another page stride
    assert triton_copy.move_shape([(a, a.clone()), (b, a.clone())]) is None


# --- the engine's choice and the SM budget -------------------------------------------------


def test_engine_uses_the_kernel_where_triton_imports(monkeypatch):
    monkeypatch.delenv("HICACHE_KERNEL_COPIES", raising=False)
    assert CudaEngine(CPU, 1).kernel_path == "triton"
    assert CudaEngine(CPU, 1, kernel_copies="torch").kernel_path == "torch"
    monkeypatch.setenv("HICACHE_KERNEL_COPIES", "torch")
    assert CudaEngine(CPU, 1).kernel_path == "torch"
    monkeypatch.setenv("HICACHE_KERNEL_COPIES", "cutlass")
    with pytest.raises(ValueError, match="unknown kernel copies 'cutlass'"):
        CudaEngine(CPU, 1)


def test_engine_without_triton_falls_back_or_refuses(monkeypatch):
    from hicache.kernels import cuda_engine

    def missing():
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(cuda_engine, "_triton", missing)
    monkeypatch.delenv("HICACHE_KERNEL_COPIES", raising=False)
    engine = CudaEngine(CPU, 1)
    assert engine.kernel_path == "torch" and "No module named 'triton'" in engine.kernel_reason
    with pytest.raises(RuntimeError, match="Triton copy kernel is unavailable"):
        CudaEngine(CPU, 1, kernel_copies="triton")


@pytest.mark.parametrize("bad", [0, -1, 1025, True, 2.0, "8", None])
def test_transfer_sms_is_validated(bad):
    with pytest.raises(ValueError, match=r"transfer_sms=.* must be an integer in \[1, 1024\]"):
        CudaEngine(CPU, 1, transfer_sms=bad)
    with pytest.raises(ConfigError, match=r"transfer_sms=.* must be an integer in \[1, 1024\]"):
        CacheConfig(transfer_sms=bad).resolve()


def test_transfer_sms_default_and_choice():
    assert CacheConfig().transfer_sms <= 8
    assert CacheConfig(transfer_sms=4).resolve()[0].transfer_sms == 4
    assert CudaEngine(CPU, 1, transfer_sms=4).transfer_sms == 4
