"""The CPU engine's row copies (rows.py) in each of their modes, and the engine paths the
transfer matrix's small pools do not reach: views merged over several buffers, moves split over
threads, direct io batched past `max_run_copies`, views off the row grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.kernels import DevicePool, HostPool, MHAGeometry, backup, load_layer
from hicache.kernels.engines import CpuEngine
from hicache.kernels.rows import RowGrid, copy_rows, page_rows_of, plan_rows, row_space
from tests.unit.kernels.reference import naive_backup, naive_load, randomize


def grid(tensor: torch.Tensor) -> RowGrid:
    found = row_space([tensor], page_rows_of(tensor))
    assert found is not None
    return found[0]


def expected_copy(dst: torch.Tensor, dst_pages, src: torch.Tensor, src_pages) -> torch.Tensor:
    out = dst.clone()
    for d, s in zip(dst_pages.tolist(), src_pages.tolist()):
        out[d] = src[s]
    return out


def run_plan(
    dst, dst_pages, src, src_pages, *, scratch_rows: int = 64, parts: int = 1, block_bytes=1 << 18
):
    plan = plan_rows(
        grid(dst), dst_pages, grid(src), src_pages, prefer_dst_order=False, block_bytes=block_bytes
    )
    row_bytes = dst.shape[-1] * dst.element_size()
    n = plan.pairs
    for i in range(parts):  # disjoint pair ranges, as the engine's threads run them
        scratch = np.empty(scratch_rows * row_bytes, dtype=np.uint8)
        copy_rows(
            grid(dst).array, grid(src).array, plan, scratch, n * i // parts, n * (i + 1) // parts
        )
    return plan.mode


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("case", ["blocks", "put", "staged"])
def test_each_mode_copies_exactly_the_planned_pages(case, parts):
    rng = np.random.default_rng(len(case) + parts)
    # (pages, 3 tokens, 5 words) with the token dim strided: rows are 5 words, 3 per page
    src_base = torch.from_numpy(rng.integers(0, 1 << 40, size=(12, 4, 5)))
    dst_base = torch.from_numpy(rng.integers(0, 1 << 40, size=(12, 3, 5)))
    src, dst = src_base[:, 1:], dst_base
    if case == "blocks":  # every destination page, shuffled: destination rows are one block
        dst_pages, src_pages = rng.permutation(12), rng.choice(12, 12, replace=False)
    elif case == "put":  # every source page: source rows are one block
        dst_pages, src_pages = rng.choice(12, 12, replace=False), rng.permutation(12)
        src = src_base[:, :3].contiguous()
        dst = torch.from_numpy(rng.integers(0, 1 << 40, size=(12, 4, 5)))[:, 1:]
    else:
        dst_pages, src_pages = rng.choice(12, 5, replace=False), rng.choice(12, 5, replace=False)
    want = expected_copy(dst, dst_pages, src, src_pages)
    src_before = src.clone()
    mode = run_plan(
        dst,
        dst_pages.astype(np.int64),
        src,
        src_pages.astype(np.int64),
        scratch_rows=2,
        parts=parts,
    )
    assert mode == case
    assert torch.equal(dst, want)
    assert torch.equal(src, src_before)


@pytest.mark.parametrize("parts", [1, 4])
def test_page_blocks_copy_runs_of_whole_destination_pages(parts):
    # destination pages contiguous (12, 3, 5): blocks found per page, some pages adjacent
    rng = np.random.default_rng(parts)
    src = torch.from_numpy(rng.integers(0, 1 << 40, size=(12, 4, 5)))[:, 1:]
    dst = torch.from_numpy(rng.integers(0, 1 << 40, size=(12, 3, 5)))
    dst_pages = np.array([7, 2, 3, 4, 10, 0], dtype=np.int64)
    src_pages = rng.choice(12, 6, replace=False).astype(np.int64)
    plan = plan_rows(
        grid(dst), dst_pages, grid(src), src_pages, prefer_dst_order=True, block_bytes=1
    )
    assert plan.mode == "blocks" and plan.dst_rows.size == 0 and len(plan.firsts) == 4
    want = expected_copy(dst, dst_pages, src, src_pages)
    src_before = src.clone()
    mode = run_plan(dst, dst_pages, src, src_pages, parts=parts, block_bytes=1)
    assert mode == "blocks"
    assert torch.equal(dst, want)
    assert torch.equal(src, src_before)


def test_views_off_the_row_grid_are_refused():
    flat = torch.zeros(64, dtype=torch.int64)
    assert page_rows_of(flat.view(4, 16)[:, 1:]) is None  # page stride 16 is not a multiple of 15
    a, b = flat[:30].view(3, 10), flat[33:63].view(3, 10)  # starts 3 words apart, rows of 10
    assert row_space([a, b], page_rows_of(a)) is None
    c = flat[30:60].view(3, 10)
    assert row_space([a, c], page_rows_of(a)) is not None


def spaced_pool(g: MHAGeometry, size: int, ps: int, gap_rows: int) -> DevicePool:
    """A pool whose buffers are slices of one tensor, `gap_rows` head rows apart: the CPU
    engine sees all of them as one row space (gap a whole number of rows) or not."""
    row = g.heads * g.head_dim
    per = size * row + gap_rows * g.head_dim
    base = torch.zeros(per * 2 * g.layers + row, dtype=g.dtype)
    bufs = [
        base[i * per : i * per + size * row].view(size, g.heads, g.head_dim)
        for i in range(2 * g.layers)
    ]
    return DevicePool.wrap(g, ps, k_buffers=bufs[0::2], v_buffers=bufs[1::2])


@pytest.mark.parametrize("gap_rows", [0, 1, 3])
@pytest.mark.parametrize("io", ["kernel", "direct"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_merged_threaded_and_batched_moves_match_naive(layout, io, gap_rows):
    g = MHAGeometry(layers=3, heads=2, head_dim=8, dtype=torch.float16)
    ps, pages = 4, 24
    device = spaced_pool(g, pages * ps, ps, gap_rows)
    host = HostPool(device, 2 * pages * ps, layout)
    rng = np.random.default_rng(gap_rows)
    randomize(host.buffer, rng)
    for l in range(g.layers):
        for c in range(2):
            randomize(device.buffer(l, c), rng)
    # 20 scattered pages: many runs (direct io batches them), both sides fragmented
    dev_slots = (
        (rng.choice(pages, 20, replace=False)[:, None] * ps + np.arange(ps))
        .ravel()
        .astype(np.int64)
    )
    host_slots = (
        (rng.choice(2 * pages, 20, replace=False)[:, None] * ps + np.arange(ps))
        .ravel()
        .astype(np.int64)
    )
    engine = CpuEngine(scratch_bytes=64, threads=3, parallel_bytes=1)

    class Shadow:  # the naive reference writes a copy of the host bytes
        geometry, layout, size, page_size, buffer = (
            g,
            host.layout,
            host.size,
            ps,
            host.buffer.clone(),
        )
        header_room = host.header_room

    naive_backup(device, Shadow, dev_slots, host_slots)
    backup(device, host, dev_slots, host_slots, io=io, engine=engine)
    assert torch.equal(host.buffer, Shadow.buffer)

    expected = [[device.buffer(l, c).clone() for c in range(2)] for l in range(g.layers)]
    randomize(host.buffer, rng)
    shadow_device = DevicePool.wrap(
        g, ps, k_buffers=[e[0] for e in expected], v_buffers=[e[1] for e in expected]
    )
    for layer in range(g.layers):
        load_layer(host, device, host_slots, dev_slots, layer, io=io, engine=engine)
        naive_load(host, shadow_device, host_slots, dev_slots, layer)
    for l in range(g.layers):
        for c in range(2):
            assert torch.equal(
                device.buffer(l, c).view(torch.uint8), shadow_device.buffer(l, c).view(torch.uint8)
            )


@pytest.mark.parametrize("parts", [1, 4])
def test_put_copies_from_several_source_blocks(parts):
    rng = np.random.default_rng(10 + parts)
    src = torch.from_numpy(rng.integers(0, 1 << 40, size=(12, 3, 5)))
    dst = torch.from_numpy(rng.integers(0, 1 << 40, size=(12, 4, 5)))[
        :, 1:
    ]  # 120-byte blocks per page
    src_pages = rng.permutation(np.array([0, 1, 2, 5, 6, 9, 10, 11], dtype=np.int64))  # three runs
    dst_pages = rng.choice(12, 8, replace=False).astype(np.int64)
    plan = plan_rows(
        grid(dst), dst_pages, grid(src), src_pages, prefer_dst_order=True, block_bytes=200
    )
    assert plan.mode == "put" and plan.firsts == (0, 15, 27)
    want = expected_copy(dst, dst_pages, src, src_pages)
    src_before = src.clone()
    assert run_plan(dst, dst_pages, src, src_pages, parts=parts, block_bytes=200) == "put"
    assert torch.equal(dst, want)
    assert torch.equal(src, src_before)


def test_rows_interleaving_across_views_and_pages_still_pair_up():
    # rows of page p, view v: 4p + offsets[v] + inner; neither page-major nor view-major order
    # sorts them (views interleave with the next page), so the plan sorts the rows themselves
    rng = np.random.default_rng(5)
    src_arr = rng.integers(0, 1 << 40, size=(40, 3))
    dst_arr = rng.integers(0, 1 << 40, size=(40, 3))
    src = RowGrid(src_arr, 4, np.array([0, 5]), np.array([0, 2]))
    dst = RowGrid(dst_arr, 4, np.array([0, 5]), np.array([0, 2]))
    src_pages = np.array([3, 0, 6], dtype=np.int64)
    dst_pages = np.array([1, 7, 2], dtype=np.int64)
    want = dst_arr.copy()
    for dp, sp in zip(dst_pages, src_pages):
        for off in (0, 5):
            for i in (0, 2):
                want[4 * dp + off + i] = src_arr[4 * sp + off + i]
    for prefer in (True, False):
        out = dst_arr.copy()
        plan = plan_rows(
            RowGrid(out, 4, dst.offsets, dst.inner),
            dst_pages,
            src,
            src_pages,
            prefer_dst_order=prefer,
        )
        copy_rows(out, src_arr, plan, np.empty(2 * 3 * 8, dtype=np.uint8))
        assert np.array_equal(out, want)
        assert sorted(plan.dst_rows.tolist()) == sorted(
            (4 * dst_pages[:, None] + np.array([0, 2, 5, 7])).ravel().tolist()
        )
