"""The hybrid-model harness (tests/hybrid/hf_models.py) restores caches exactly.

For each tiny model (sliding window + full attention, Mamba2 + attention, gated delta-net +
attention), a cache hit of length h built from the plain per-token K/V and the recurrent state
snapshot at h reproduces a full forward's logits of tokens[h:]; a wrong window token, a state from
one position off, or a changed K of position 0 is detected; K/V older than the window is never
needed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch
from transformers import DynamicCache

from tests.hybrid.hf_models import (
    KINDS,
    VOCAB,
    Snapshots,
    attention_geometry,
    full_logits,
    layer_specs,
    prefill_snapshots,
    resume_logits,
    state_shapes,
    tiny_model,
)

PROMPT = 64
HITS = (11, 29, 37)  # hit lengths: below the window, and not multiples of the chunk sizes
POINTS = sorted({p for h in HITS for p in (h - 1, h)})  # snapshots at h and one token before
EXACT = 1e-5
DETECTED = 5e-4


class Case:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.model = tiny_model(kind, seed=0)
        self.specs = layer_specs(self.model)
        gen = torch.Generator().manual_seed(1)
        self.tokens: list[int] = torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist()
        self.ref = full_logits(self.model, self.tokens)
        self.snaps: Snapshots = prefill_snapshots(self.model, self.tokens, POINTS)

    def layers(self, kind: str) -> list[int]:
        return [i for i, spec in enumerate(self.specs) if spec.kind == kind]

    def kv_at(self, h: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The per-token K/V a hit of length h provides: positions [0, h), copies."""
        return {i: (k[:h].clone(), v[:h].clone()) for i, (k, v) in self.snaps.kv.items()}

    def error(
        self,
        h: int,
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
        states: dict[int, dict[str, torch.Tensor]],
    ) -> float:
        out = resume_logits(self.model, self.tokens, h, kv, states)
        assert out.shape == (PROMPT - h, VOCAB)
        return (out - self.ref[h:]).abs().max().item()


@pytest.fixture(scope="module", params=KINDS)
def case(request: pytest.FixtureRequest) -> Case:
    return Case(request.param)


def test_layout(case: Case) -> None:
    kinds = {spec.kind for spec in case.specs}
    assert "full" in kinds and len(kinds) == 2  # a hybrid: full attention plus one other kind
    kv_heads, head_dim = attention_geometry(case.model)
    attention = case.layers("full") + case.layers("sliding")
    assert sorted(case.snaps.kv) == sorted(attention)
    for k, v in case.snaps.kv.values():
        assert k.shape == v.shape == (PROMPT, kv_heads, head_dim)
        assert k.dtype == torch.float32 and k.is_contiguous()
    assert sorted(case.snaps.states) == POINTS
    shapes = state_shapes(case.model)
    for at_point in case.snaps.states.values():
        assert sorted(at_point) == case.layers("recurrent")
        for state in at_point.values():
            assert {name: tuple(t.shape) for name, t in state.items()} == shapes


def test_kv_does_not_depend_on_chunking(case: Case) -> None:
    """Every token's K/V (sliding layers' too) is the same from one whole prefill."""
    whole = prefill_snapshots(case.model, case.tokens, [])
    for i, (k, v) in case.snaps.kv.items():
        assert torch.allclose(whole.kv[i][0], k, rtol=0, atol=EXACT)
        assert torch.allclose(whole.kv[i][1], v, rtol=0, atol=EXACT)


def test_kv_matches_a_standard_cache(case: Case) -> None:
    """The recorded K/V equals what transformers' own cache keeps after one plain forward: every
    position for full layers, the last W - 1 for sliding ones (with the model's own masks)."""
    cache = DynamicCache(config=case.model.config)
    with torch.no_grad():
        case.model(input_ids=torch.tensor([case.tokens]), past_key_values=cache, use_cache=True)
    for i, (k, v) in case.snaps.kv.items():
        keys, values = (
            cache.layers[i].keys[0].transpose(0, 1),
            cache.layers[i].values[0].transpose(0, 1),
        )
        assert len(keys) == (PROMPT if case.specs[i].kind == "full" else case.specs[i].window - 1)
        assert torch.allclose(keys, k[-len(keys) :], rtol=0, atol=EXACT)
        assert torch.allclose(values, v[-len(values) :], rtol=0, atol=EXACT)


@pytest.mark.parametrize("h", HITS)
def test_resume_is_exact(case: Case, h: int) -> None:
    assert case.error(h, case.kv_at(h), case.snaps.states[h]) <= EXACT


@pytest.mark.parametrize("h", HITS)
def test_wrong_cache_is_detected(case: Case, h: int) -> None:
    states = case.snaps.states[h]
    # One full-attention layer's K of position 0 changed.
    kv = case.kv_at(h)
    full = case.layers("full")[0]
    kv[full][0][0] += torch.randn(kv[full][0][0].shape, generator=torch.Generator().manual_seed(2))
    assert case.error(h, kv, states) >= DETECTED
    # Recurrent layers: the state after token h - 2 instead of h - 1.
    if case.layers("recurrent"):
        assert case.error(h, case.kv_at(h), case.snaps.states[h - 1]) >= DETECTED
    # Sliding layers: the oldest token of the window (h - W + 1) zeroed.
    sliding = case.layers("sliding")
    window = case.specs[sliding[0]].window if sliding else None
    if window is not None and h >= window:
        kv = case.kv_at(h)
        for i in sliding:
            kv[i][0][h - window + 1] = 0
            kv[i][1][h - window + 1] = 0
        assert case.error(h, kv, states) >= DETECTED


@pytest.mark.parametrize("h", HITS)
def test_only_the_window_is_needed(case: Case, h: int) -> None:
    sliding = case.layers("sliding")
    if not sliding:
        pytest.skip(f"{case.kind} has no sliding-window layers")
    window = case.specs[sliding[0]].window
    assert window is not None
    kv = case.kv_at(h)
    gen = torch.Generator().manual_seed(3)
    for i in sliding:
        for t in kv[i]:
            old = t[: max(h - window + 1, 0)]
            old.copy_(torch.randn(old.shape, generator=gen) * 100)
    assert case.error(h, kv, case.snaps.states[h]) <= EXACT
