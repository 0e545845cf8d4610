"""The hybrid layer groups' rules (hicache/hybrid/groups.py): declaration errors, and the
one usable hit length every group can resume from."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.config import ConfigError
from hicache.hybrid import FullAttention, HybridModel, NoCache, Recurrent, SlidingWindow

PAGE = 4


def gemma_like() -> HybridModel:
    return HybridModel((SlidingWindow((0, 1, 3), window=6), FullAttention((2,))), PAGE)


def bamba_like(grid: int = 8) -> HybridModel:
    return HybridModel(
        (Recurrent((0, 1, 3), state_bytes=100, grid=grid), FullAttention((2,))), PAGE
    )


@pytest.mark.parametrize(
    "groups, page, message",
    [
        ((), PAGE, "at least one layer group"),
        ((FullAttention(()),), PAGE, "has no layers"),
        (
            (FullAttention((0,)), SlidingWindow((0,), 4)),
            PAGE,
            r"layer 0 is in two groups that both hold its K/V \(FullAttention and SlidingWindow\)",
        ),
        (
            (FullAttention((0,)), Recurrent((0,), 10, 8), Recurrent((0,), 10, 8)),
            PAGE,
            "layer 0 is in two groups that both hold its state",
        ),
        ((FullAttention((0,)), NoCache((0,))), PAGE, "layer 0 is in NoCache and in FullAttention"),
        (
            (NoCache((1,)), FullAttention((0, 1))),
            PAGE,
            "layer 1 is in NoCache and in FullAttention",
        ),
        ((FullAttention((0,)), NoCache((1,)), NoCache((1,))), PAGE, "two NoCache groups"),
        ((FullAttention((0,)), NoCache(())), PAGE, "NoCache group has no layers"),
        ((FullAttention((0, 2)),), PAGE, r"layers \[1\] are in no group \(a layer that keeps"),
        ((SlidingWindow((0,), 0),), PAGE, "window must be >= 1"),
        ((FullAttention((0,)), Recurrent((1,), 0, 8)), PAGE, "state_bytes must be > 0"),
        ((FullAttention((0,)), Recurrent((1,), 10, 6)), PAGE, "multiple of the page size"),
        ((NoCache((0, 1)),), PAGE, "the model keeps nothing"),
        ((FullAttention((-1,)),), PAGE, "layers count from 0"),
        ((FullAttention((0,)), SlidingWindow((1,), 4, 10)), PAGE, "state_bytes needs a grid"),
        ((FullAttention((0,)), SlidingWindow((1,), 4, 0, 8)), PAGE, "state_bytes must be > 0"),
        ((FullAttention((0,)), SlidingWindow((1,), 4, 10, 6)), PAGE, "multiple of the page"),
        ((FullAttention((0,)),), 0, "page_size must be > 0"),
    ],
)
def test_bad_declarations_name_what_is_wrong(groups, page, message):
    with pytest.raises(ConfigError, match=message):
        HybridModel(groups, page)


@pytest.mark.parametrize(
    "groups",
    [
        (Recurrent((0, 1), state_bytes=6144, grid=8),),  # Mamba2, FalconMamba, RWKV-like
        (SlidingWindow((0, 1, 2), window=6, state_bytes=90, grid=8),),  # Mistral-v0.1-like
        (  # Samba-like: windowed sliding beside recurrent layers, no full attention
            Recurrent((0, 2), state_bytes=64, grid=8),
            SlidingWindow((1, 3), window=6, state_bytes=40, grid=16),
        ),
        (Recurrent((0, 2), state_bytes=64, grid=8), NoCache((1,))),
    ],
    ids=["recurrent", "windowed", "windowed+recurrent", "recurrent+nocache"],
)
def test_a_model_with_no_layer_kept_as_pages_resumes_at_its_snapshots_alone(groups):
    model = HybridModel(groups, PAGE)
    assert model.pool_layers == ()  # its pool has 0 layers: pages of tokens alone
    assert model.stateful and model.state_bytes == sum(g.state_bytes for g in model.stateful)
    assert model.usable(30, 28, ()) == 0  # fail closed: nothing else to resume from
    assert model.usable(30, 28, [model.grid, 28]) == 28
    assert model.usable(30, 20, [model.grid, 28]) == (model.grid if model.grid <= 20 else 0)
    assert model.snapshot_points(30)[-1] == 28


def test_windowed_sliding_layers_leave_the_pool_and_resume_only_at_a_snapshot():
    model = HybridModel(
        (
            SlidingWindow((0, 2), window=6, state_bytes=40, grid=8),
            FullAttention((1,)),
            Recurrent((3,), state_bytes=10, grid=12),
        ),
        PAGE,
    )
    assert model.pool_layers == (1,) and model.attention_layers == (0, 1, 2)
    assert [type(g).__name__ for g in model.stateful] == ["SlidingWindow", "Recurrent"]
    assert model.state_bytes == 50 and model.grid == 24
    assert model.usable(30, 28, ()) == 0  # fail closed: the window lives only in snapshots
    assert model.usable(30, 28, [24, 28]) == 28
    alone = HybridModel((SlidingWindow((0,), 6, 40, 8), FullAttention((1,))), PAGE)
    assert alone.snapshot_points(30) == [8, 16, 24, 28] and alone.recurrent == ()


def test_a_layer_may_hold_kv_and_a_state_or_no_cache_at_all():
    """Falcon-H1 (every layer attention and Mamba2), Zamba2 (Mamba2 everywhere, a shared
    attention block's K/V on some layers), Nemotron-H (MLP-only layers): declared by the
    model's layer numbers."""
    falcon = HybridModel(
        (FullAttention((0, 1, 2)), Recurrent((0, 1, 2), state_bytes=30, grid=8)), PAGE
    )
    assert falcon.pool_layers == (0, 1, 2) and falcon.recurrent[0].layers == (0, 1, 2)
    zamba = HybridModel(
        (Recurrent((0, 1, 2, 3, 4), state_bytes=50, grid=8), FullAttention((1, 4))), PAGE
    )
    assert zamba.pool_layers == (1, 4) and zamba.attention_layers == (1, 4)
    nemotron = HybridModel((Recurrent((0, 3), 20, 8), NoCache((1, 4)), FullAttention((2,))), PAGE)
    assert nemotron.pool_layers == (2,) and nemotron.attention_layers == (2,)
    assert nemotron.state_bytes == 20 and [type(g) for g in nemotron.stateful] == [Recurrent]
    for model in (falcon, zamba, nemotron):
        assert model.usable(30, 28, [8, 16]) == 16  # the rule is the recurrent groups'
    hymba = HybridModel(
        (SlidingWindow((0, 1), 6), FullAttention((2,)), Recurrent((0, 1, 2), 30, 8)), PAGE
    )  # sliding and full attention heads beside a state in every layer
    assert hymba.pool_layers == (0, 1, 2)


def test_attention_layers_map_to_pool_layers_in_model_order():
    assert gemma_like().pool_layers == (0, 1, 2, 3)
    assert bamba_like().pool_layers == (2,)
    assert bamba_like().state_bytes == 100


def test_without_recurrent_groups_a_hit_is_the_whole_pages_below_the_last_token():
    model = gemma_like()
    assert model.usable(n_tokens=21, kv_len=40) == 20
    assert model.usable(n_tokens=20, kv_len=40) == 16  # the last token is always computed
    assert model.usable(n_tokens=40, kv_len=13) == 12
    assert model.snapshot_points(40) == [] and model.candidates(40, 40, 8) == []


def test_recurrent_groups_resume_only_at_a_snapshot():
    model = bamba_like()
    assert model.usable(n_tokens=30, kv_len=28, snapshots=()) == 0  # fail closed
    assert model.usable(30, 28, [8, 16, 24]) == 24
    assert model.usable(30, 20, [8, 16, 24]) == 16  # K/V ends before the deepest snapshot
    assert model.usable(30, 28, [6]) == 0  # not on a page: never a hit
    assert model.snapshot_points(30) == [8, 16, 24, 28]
    assert model.candidates(30, 30, 8) == [28, 24, 16, 8]
    assert model.candidates(30, 30, 2) == [28, 24]


def test_the_grid_of_two_recurrent_groups_is_where_both_keep_a_snapshot():
    model = HybridModel(
        (Recurrent((0,), 10, 8), Recurrent((1,), 20, 12), FullAttention((2,))), PAGE
    )
    assert model.grid == 24 and model.state_bytes == 30


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 200),
    kv=st.integers(0, 200),
    snaps=st.lists(st.integers(0, 200), max_size=10),
    grid_pages=st.integers(1, 4),
)
def test_a_usable_hit_is_valid_for_every_group(n, kv, snaps, grid_pages):
    model = bamba_like(grid=grid_pages * PAGE)
    h = model.usable(n, kv, snaps)
    assert h == 0 or (h in snaps and h <= kv and h <= n - 1 and h % PAGE == 0)
    best = [p for p in snaps if 0 < p <= min(kv, n - 1) and p % PAGE == 0]
    assert h == max(best, default=0)  # and no valid one is deeper
