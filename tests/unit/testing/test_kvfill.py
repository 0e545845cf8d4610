"""The stand-in KV (hicache/testing/kvfill.py): its page path (whole aligned pages written and
checked as blocks) writes the same bytes and finds the same bad pages as its row path, for
aligned, partly aligned and scattered slots, any first position, with and without the compiled
row copier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.kernels.geometry import parse_geometry
from hicache.kernels.pools import DevicePool
from hicache.testing import kvfill

SPECS = ["mha:2:1:32:float16", "mha:3:2:8:bfloat16", "mla:2:16:4:float16", "mha:1:1:3:float16"]


def rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvfill, "_page_table", lambda width, page_size: None)


def case(rng: np.random.Generator, trial: int) -> tuple[str, int, int, int, np.ndarray]:
    spec = SPECS[trial % len(SPECS)]
    page = int(rng.choice([1, 2, 4, 16, 64]))
    size = page * int(rng.integers(8, 40))
    first = int(rng.integers(0, 3 * page + 1))
    n = int(rng.integers(1, size // 2))
    mode = trial % 3
    if mode == 0:  # whole aligned pages, the first and last possibly partial
        head = -first % page
        pages = rng.choice(size // page, size=min(n // page + 2, size // page), replace=False)
        slots = (pages[:, None] * page + np.arange(page)).reshape(-1)
        slots = slots[(page - head) % page :][:n]
    elif mode == 1:  # scattered tokens
        slots = rng.choice(size, size=n, replace=False)
    else:  # whole pages with two tokens swapped
        pages = rng.choice(size // page, size=max(1, n // page), replace=False)
        slots = (pages[:, None] * page + np.arange(page)).reshape(-1)
        if len(slots) > 2:
            slots[1], slots[2] = slots[2], slots[1]
    return spec, page, size, first, slots


def pool_bytes(pool: DevicePool) -> list[torch.Tensor]:
    geo = pool.geometry
    return [
        pool.buffer(layer, comp).view(torch.uint8).clone()
        for layer in range(geo.layers)
        for comp in range(geo.components)
    ]


@pytest.mark.parametrize("native", [True, False])
def test_page_path_matches_row_path(monkeypatch, native):
    if not native:
        monkeypatch.setattr(kvfill, "native_rows", lambda: None)
    rng = np.random.default_rng(3)
    paged = 0
    for trial in range(120):
        spec, page, size, first, slots = case(rng, trial)
        seeds = rng.integers(0, 1 << 16, size=(first + len(slots)) // page + 2)
        pools = [DevicePool.allocate(parse_geometry(spec), size, page) for _ in range(2)]
        kvfill.fill(pools[0], slots, seeds, page_size=page, first=first)
        paged += kvfill._Split(pools[0], slots, seeds, page, first).pages is not None
        with monkeypatch.context() as m:
            rows_only(m)
            kvfill.fill(pools[1], slots, seeds, page_size=page, first=first)
        assert all(torch.equal(a, b) for a, b in zip(pool_bytes(pools[0]), pool_bytes(pools[1])))
        assert kvfill.count_bad_pages(pools[0], slots, seeds, page_size=page, first=first) == 0
        geo = pools[0].geometry
        for _ in range(int(rng.integers(1, 5))):  # the same damage to both pools
            layer, comp = int(rng.integers(geo.layers)), int(rng.integers(geo.components))
            row = (
                int(slots[rng.integers(len(slots))])
                if rng.random() < 0.8
                else int(rng.integers(size))
            )
            for pool in pools:
                flat = pool.buffer(layer, comp).view(torch.uint8).reshape(size, -1)
                flat[row, int(rng.integers(flat.shape[1]))] ^= 0x5A
        found = kvfill.count_bad_pages(pools[0], slots, seeds, page_size=page, first=first)
        with monkeypatch.context() as m:
            rows_only(m)
            assert found == kvfill.count_bad_pages(
                pools[1], slots, seeds, page_size=page, first=first
            )
    assert paged > 20  # the page path was taken


def test_too_few_seeds_is_an_index_error():
    pool = DevicePool.allocate(parse_geometry("mha:1:1:8:float16"), 64, 4)
    with pytest.raises(IndexError):
        kvfill.fill(pool, np.arange(16), np.zeros(2, dtype=np.int64), page_size=4, first=0)


def test_device_path_writes_and_finds_what_the_host_path_does():
    """The torch path that GPU pools take, run here on CPU tensors: the same bytes as the numpy
    path, and the same bad pages after the same damage."""
    rng = np.random.default_rng(5)
    for trial in range(60):
        spec, page, size, first, slots = case(rng, trial)
        seeds = rng.integers(0, 1 << 16, size=(first + len(slots)) // page + 2)
        pools = [DevicePool.allocate(parse_geometry(spec), size, page) for _ in range(2)]
        kvfill.fill(pools[0], slots, seeds, page_size=page, first=first)
        kvfill._fill_on_device(pools[1], np.asarray(slots), seeds, page, first)
        assert all(torch.equal(a, b) for a, b in zip(pool_bytes(pools[0]), pool_bytes(pools[1])))
        assert kvfill._bad_on_device(pools[1], np.asarray(slots), seeds, page, first) == 0
        geo = pools[0].geometry
        for _ in range(int(rng.integers(1, 5))):
            layer, comp = int(rng.integers(geo.layers)), int(rng.integers(geo.components))
            row = int(slots[rng.integers(len(slots))])
            for pool in pools:
                flat = pool.buffer(layer, comp).view(torch.uint8).reshape(size, -1)
                flat[row, int(rng.integers(flat.shape[1]))] ^= 0x5A
        want = kvfill.count_bad_pages(pools[0], slots, seeds, page_size=page, first=first)
        assert want > 0
        assert kvfill._bad_on_device(pools[1], np.asarray(slots), seeds, page, first) == want


def test_pools_off_the_host_take_the_device_path(monkeypatch):
    calls = []
    monkeypatch.setattr(kvfill, "_fill_on_device", lambda *a: calls.append("fill"))
    monkeypatch.setattr(kvfill, "_bad_on_device", lambda *a: calls.append("check") or 7)
    pool = DevicePool.allocate(parse_geometry("mha:1:1:8:float16"), 16, 4)
    monkeypatch.setattr(pool, "device", torch.device("cuda:0"))  # where a GPU pool lives
    seeds = np.zeros(4, dtype=np.int64)
    kvfill.fill(pool, np.arange(8), seeds, page_size=4, first=0)
    assert kvfill.count_bad_pages(pool, np.arange(8), seeds, page_size=4, first=0) == 7
    assert calls == ["fill", "check"]
