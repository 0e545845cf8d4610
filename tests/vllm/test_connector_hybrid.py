"""The connector over several KV cache groups (vLLM's hybrid KV cache manager), without vLLM
running (these run in the main environment too; vLLM's own spec classes where installed):
the groups mapped onto hicache's HybridModel, which blocks a hit restores per group, a null
block where the window needs K/V refusing the load (a miss, never a hole), the worker's
stores and loads per group over aliased fake KV tensors, failures reported per request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_connector_units import H, _Req

from hicache.hybrid import FullAttention, SlidingWindow
from hicache.integrations.vllm import (
    ConnectorOptions,
    HiCacheMetadata,
    LoadPlan,
    SchedulerSide,
    WorkerSide,
    geometry_of,
)
from hicache.integrations.vllm.groups import check_policies, hole, hybrid_model, needs, storable
from hicache.integrations.vllm.layout import NULL_BLOCK, Geometry, GroupGeometry

BS, W, BLOCKS = 32, 48, 12
LAYER = 1 * BS * 2 * 64 * 4  # one layer's block: 1 head, K and V of 64, float32


def _specs() -> tuple[object, object]:
    """vLLM's FullAttentionSpec and SlidingWindowSpec (stand-ins where vLLM is absent)."""
    try:
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    except ImportError:
        full = type("FullAttentionSpec", (SimpleNamespace,), {})
        sliding = type("SlidingWindowSpec", (SimpleNamespace,), {})
        kw = dict(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32)
        return full(page_size_bytes=LAYER, **kw), sliding(
            page_size_bytes=LAYER, sliding_window=W, **kw
        )
    kw = dict(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32)
    return FullAttentionSpec(**kw), SlidingWindowSpec(sliding_window=W, **kw)


def _kv_cache_config(*specs: object) -> SimpleNamespace:
    names = [["l0", "l2"], ["l1", "l3"], ["l4", "l5"]]
    return SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=s, layer_names=names[i]) for i, s in enumerate(specs)
        ],
        kv_cache_layout="NHD",
    )


def _geometry() -> Geometry:
    full, sliding = _specs()
    return geometry_of(SimpleNamespace(), _kv_cache_config(sliding, full))


def test_geometry_of_vllms_groups_and_the_hybrid_model_it_maps_to():
    geo = _geometry()
    assert [p.kind for p in geo.parts] == ["sliding", "full"] and geo.hybrid
    assert geo.layers == ("l0", "l2", "l1", "l3") and geo.page_bytes == 4 * LAYER
    assert geo.parts[0].window == W and geo.parts[0].page_bytes == 2 * LAYER
    model = hybrid_model(geo)
    assert model.groups == (SlidingWindow((0, 1), W), FullAttention((2, 3)))
    # Sliding groups kept as pages: a hit is every whole page short of the last token.
    assert model.usable(170, 5 * BS) == 5 * BS and model.usable(161, 10 * BS) == 5 * BS
    # The namespace tells hybrid pages from a single group's of the same layer count.
    full, _ = _specs()
    one = geometry_of(SimpleNamespace(), _kv_cache_config(full))
    assert not one.hybrid and one.layout not in geo.layout and "sliding48x2" in geo.layout


def test_groups_this_connector_cannot_store_are_refused_by_name():
    full, _ = _specs()
    try:
        from vllm.v1.kv_cache_interface import MambaSpec

        mamba: object = MambaSpec(block_size=BS, shapes=((3, 8),), dtypes=(torch.float32,))
    except ImportError:
        mamba = type("MambaSpec", (SimpleNamespace,), {})(block_size=BS, page_size_bytes=96)
    with pytest.raises(ValueError, match="MambaSpec"):
        geometry_of(SimpleNamespace(), _kv_cache_config(mamba, full))
    other = type(full)(**{**full.__dict__, "block_size": 2 * BS})  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="block sizes"):
        geometry_of(SimpleNamespace(), _kv_cache_config(full, other))
    with pytest.raises(ValueError, match="write_back"):
        check_policies("write_back", _geometry())
    check_policies("write_through", _geometry())
    check_policies("write_back", geometry_of(SimpleNamespace(), _kv_cache_config(full)))


def test_a_hit_restores_each_group_only_as_far_as_it_needs():
    geo = _geometry()
    sliding, full = geo.parts
    hit = 4 * BS  # 128: the window needs tokens [81, 128): pages 2 and 3
    assert [needs(sliding, p, hit, BS) for p in range(5)] == [False, False, True, True, False]
    assert [needs(full, p, hit, BS) for p in range(5)] == [True, True, True, True, False]
    rows = [(NULL_BLOCK, 5), (NULL_BLOCK, 6), (7, 8), (9, 10)]
    assert hole(geo, rows, 0, hit) is None  # vLLM nulled pages 0-1 of the window: fine
    assert hole(geo, [(NULL_BLOCK, 5), (NULL_BLOCK, 6), (NULL_BLOCK, 8), (9, 10)], 0, hit) == (2, 0)
    # A full attention group never has a hole (its blocks are always the request's).
    assert storable(geo, (7, 8)) and not storable(geo, (NULL_BLOCK, 8))


# ------------------------------------------------------------------------------ scheduler


class _Blocks:
    def __init__(self, *ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.ids


def _output(new=(), cached=()):
    return SimpleNamespace(
        num_scheduled_tokens={
            **{r.request_id: n for r, _, _, n in new},
            **{r.request_id: n for r, _, _, n in cached},
        },
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r.request_id, block_ids=ids, num_computed_tokens=c)
            for r, ids, c, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r.request_id for r, _, _, _ in cached],
            new_block_ids=[ids for _, ids, _, _ in cached],
            resumed_req_ids=set(),
            num_computed_tokens=[c for _, _, c, _ in cached],
        ),
    )


def test_the_scheduler_stores_whole_pages_and_loads_every_group_asynchronously():
    s = SchedulerSide(ConnectorOptions(), _geometry(), 16)
    a = _Req("a", list(range(5 * BS + 10)))
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    # Prefill in two chunks; before the second, vLLM nulled page 0 of the sliding group.
    meta = s.build_meta(_output(new=[(a, ([1, 2, 3], [11, 12, 13]), 0, 3 * BS)]))
    assert meta.store_blocks == [(1, 11), (2, 12), (3, 13)]
    meta = s.build_meta(_output(cached=[(a, ([4, 5, 6], [14, 15, 16]), 3 * BS, 2 * BS + 10)]))
    assert meta.store_blocks == [(4, 14), (5, 15)]  # the pages computed by this step's end
    # The same prompt again: a hit of every whole page, asynchronous (a hybrid model's
    # failed load is reported per request), each page's blocks in group order.
    b = _Req("b", list(range(5 * BS + 10)))
    assert s.get_num_new_matched_tokens(b, 0) == (5 * BS, True)
    s.update_state_after_alloc(b, _Blocks([0, 0, 0, 7, 8, 9], [21, 22, 23, 24, 25, 26]), 5 * BS)
    (plan,) = s.build_meta(_output()).loads
    assert plan.background and plan.block_ids == [(0, 21), (0, 22), (0, 23), (7, 24), (8, 25)]
    assert min(plan.slots) >= 0 and not any(plan.read)


def test_a_null_block_inside_the_window_refuses_the_load():
    s = SchedulerSide(ConnectorOptions(), _geometry(), 16)
    a = _Req("a", list(range(4 * BS + 3)))
    s.get_num_new_matched_tokens(a, 0)
    s.build_meta(_output(new=[(a, ([1, 2, 3, 4], [11, 12, 13, 14]), 0, 4 * BS + 3)]))
    b = _Req("b", list(range(4 * BS + 3)))
    assert s.get_num_new_matched_tokens(b, 0) == (4 * BS, True)
    # Page 2 holds tokens [64, 96), inside the window [81, 128): vLLM must have given a block.
    s.update_state_after_alloc(b, _Blocks([0, 0, 0, 7, 8], [21, 22, 23, 24, 25]), 4 * BS)
    (plan,) = s.build_meta(_output()).loads
    assert plan.slots == [-1, -1, -1, -1]  # the worker fails it: vLLM recomputes the request
    # vLLM reports the failure (failed_recving, then finished_recving) and looks the request
    # up again: nothing is offered, so a load that cannot land is not planned twice.
    s.loads_failed({"b"})
    s.loads_ended({"b"})
    assert s.get_num_new_matched_tokens(b, 0) == (0, False)
    assert s.idle
    s.request_finished(b, ([], []))
    s.request_finished(a, ([], []))
    assert not s._requests  # every table empty once the requests are gone


# ------------------------------------------------------------------------------- worker


def _worker() -> WorkerSide:
    """Four layers in two groups over two tensors, aliased as vLLM's hybrid manager lays
    them out (group 0's layer i and group 1's layer i share one tensor)."""
    geo = _geometry()
    w = WorkerSide(ConnectorOptions(), geo, BLOCKS, None)
    torch.manual_seed(3)
    shared = [torch.randn(BLOCKS, 1, BS, 128) for _ in range(2)]
    kv = {"l0": shared[0], "l2": shared[1], "l1": shared[0], "l3": shared[1]}
    w.register_kv_caches(kv)
    w.kv = kv  # type: ignore[attr-defined]
    return w


def test_the_worker_stores_and_loads_each_groups_own_blocks():
    w = _worker()
    kv = w.kv  # type: ignore[attr-defined]
    before = {n: t.clone() for n, t in kv.items()}
    m = HiCacheMetadata(4, w.geometry.page_bytes)
    # Page 0: sliding block 1, full block 2; page 1: sliding 3, full 4.
    m.store_blocks, m.store_slots, m.store_hashes = [(1, 2), (3, 4)], [0, 1], H[:2]
    w.save(m)
    m2 = HiCacheMetadata(4, w.geometry.page_bytes)
    # Page 0's sliding block is null (out of the window): only its full part lands.
    m2.loads = [LoadPlan("r", [(NULL_BLOCK, 6), (7, 8)], [0, 1], H[:2], [False, False], True)]
    w.start_load(m2)
    assert w.poll(set()) == (set(), {"r"}) and w.take_failed() == set()
    for name in ("l0", "l2"):  # sliding layers: block 7 <- 3; block 0 untouched
        assert torch.equal(kv[name][7], before[name][3])
        assert torch.equal(kv[name][0], before[name][0])
    for name in ("l1", "l3"):  # full layers: 6 <- 2, 8 <- 4
        assert torch.equal(kv[name][6], before[name][2])
        assert torch.equal(kv[name][8], before[name][4])
    assert w.take_errors() == set()


def test_a_failed_hybrid_load_fails_its_request_not_blocks():
    w = _worker()
    kv = w.kv  # type: ignore[attr-defined]
    before = {n: t.clone() for n, t in kv.items()}
    m = HiCacheMetadata(4, w.geometry.page_bytes)
    m.loads = [LoadPlan("r", [(5, 6), (7, 8)], [-1, -1], H[:2], [False, False], True)]
    w.start_load(m)
    assert w.poll(set()) == (set(), {"r"})
    assert w.take_failed() == {"r"} and w.take_errors() == set()  # per request, no block ids
    assert w.take_failed() == set()  # reported once
    for name, t in kv.items():  # nothing written
        assert torch.equal(t, before[name]), name
    assert w.stats.take()["load_errors"] == 2


def test_the_worker_refuses_tensors_that_do_not_match_a_groups_spec():
    geo = Geometry(
        BS,
        ("l0", "l1"),
        2 * LAYER,
        "mha:2:1:64:float32",
        "t",
        (GroupGeometry("sliding", ("l0",), LAYER, W), GroupGeometry("full", ("l1",), LAYER)),
    )
    w = WorkerSide(ConnectorOptions(), geo, BLOCKS, None)
    with pytest.raises(NotImplementedError, match="no KV tensor"):
        w.register_kv_caches({"l0": torch.zeros(BLOCKS, 1, BS, 128)})
