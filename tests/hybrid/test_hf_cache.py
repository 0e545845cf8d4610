"""Hybrid models through hicache, end to end (#19): a tiny random-weight model's prefill is
stored through `HybridCache` (K/V of every attention layer in the pool, recurrent snapshots
as state chains), pushed down to L2, and to L3 where a second instance over the same file
store reads it; the hit is loaded back and fed to the model as its cache, and the suffix's
logits must equal a full forward's within 1e-5 (fp32). In the same tests, a wrong cache is
caught: a snapshot from another point, or the window's oldest token zeroed. Recurrent models
run twice: snapshots in the K/V pools, and in a states cache of their own (`state_config`)."""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager

import pytest

pytest.importorskip("transformers")

import numpy as np
import torch

from hicache import CacheConfig, HiCache
from hicache.hybrid import (
    FullAttention,
    HybridCache,
    HybridModel,
    Recurrent,
    SlidingWindow,
    state_config,
)
from hicache.testing import run_virtual
from tests.hybrid.hf_models import (
    KINDS,
    VOCAB,
    attention_geometry,
    full_logits,
    layer_specs,
    prefill_snapshots,
    resume_logits,
    state_shapes,
    tiny_model,
)

PAGE = 4
GRID = 8
EXACT, WRONG = 1e-5, 5e-4


class Adapter:
    """Moves one model's cache between its tensors and the cache's pool and snapshot bytes."""

    def __init__(self, model):
        self.model = model
        self.specs = layer_specs(model)
        self.kv_heads, self.head_dim = attention_geometry(model)
        self.shapes = state_shapes(model) if self.recurrent_layers else {}
        state_bytes = len(self.recurrent_layers) * sum(
            int(np.prod(s)) * 4 for s in self.shapes.values()
        )
        groups = []
        full = tuple(i for i, s in enumerate(self.specs) if s.kind == "full")
        sliding = [i for i, s in enumerate(self.specs) if s.kind == "sliding"]
        if full:
            groups.append(FullAttention(full))
        if sliding:
            groups.append(SlidingWindow(tuple(sliding), self.specs[sliding[0]].window))
        if self.recurrent_layers:
            groups.append(Recurrent(tuple(self.recurrent_layers), state_bytes, GRID))
        self.hybrid = HybridModel(tuple(groups), PAGE)

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.specs) if s.kind == "recurrent"]

    def config(self, **overrides) -> CacheConfig:
        kv = f"mha:{len(self.hybrid.attention_layers)}:{self.kv_heads}:{self.head_dim}:float32"
        base = dict(
            kv=kv, page_size=PAGE, device_tokens=256, host_tokens=1024, deterministic=True,
            write_policy="write_through", model_id="tiny-hybrid", prefetch_policy="wait_complete",
            prefetch_threshold=2 * PAGE,
        )  # fmt: skip
        base.update(overrides)
        return CacheConfig(**base)

    def pack(self, states: dict[int, dict[str, torch.Tensor]]) -> bytes:
        parts = [states[i][name].reshape(-1) for i in self.recurrent_layers for name in self.shapes]
        return torch.cat(parts).numpy().tobytes() if parts else b""

    def unpack(self, blob: bytes | None) -> dict[int, dict[str, torch.Tensor]]:
        if not self.recurrent_layers:
            return {}
        flat = torch.frombuffer(bytearray(blob), dtype=torch.float32)
        out, at = {}, 0
        for i in self.recurrent_layers:
            out[i] = {}
            for name, shape in self.shapes.items():
                n = int(np.prod(shape))
                out[i][name] = flat[at : at + n].reshape(shape).clone()
                at += n
        return out

    def write_kv(self, pool, slots, kv, first: int) -> None:
        index = torch.as_tensor(np.array(slots), dtype=torch.int64)
        for p, layer in enumerate(self.hybrid.attention_layers):
            k, v = kv[layer]
            pool.k_buffer(p)[index] = k[first : first + len(slots)]
            pool.v_buffer(p)[index] = v[first : first + len(slots)]

    def read_kv(self, pool, slots) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        index = torch.as_tensor(np.array(slots), dtype=torch.int64)
        return {
            layer: (pool.k_buffer(p)[index].clone(), pool.v_buffer(p)[index].clone())
            for p, layer in enumerate(self.hybrid.attention_layers)
        }

    async def serve(self, hc: HybridCache, rid: str, tokens: list[int]):
        """Run one request as an engine would: resume from the hit (the logits of the rest
        come from the restored cache), store K/V and snapshots. Returns (hit, logits of
        tokens[hit:], the K/V and states it resumed from)."""
        hit = await hc.match(rid, tokens)
        h = hit.length
        kv = self.read_kv(hc.cache.device_pool, hit.device_slots)
        states = self.unpack(hit.state) if h else {}
        logits = resume_logits(self.model, tokens, h, kv, states) if h else None
        points = hc.model.snapshot_points(len(tokens))
        snaps = prefill_snapshots(self.model, tokens, points)
        fresh = await hc.allocate(rid, len(tokens) - h)
        self.write_kv(hc.cache.device_pool, fresh, snaps.kv, first=h)
        packed = {p: self.pack(snaps.states[p]) for p in points if p > h}
        slots = np.concatenate([hit.device_slots, fresh])
        await hc.cache_finished(rid, tokens, slots, snapshots=packed)
        return hit, logits, kv, states


def error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@asynccontextmanager
async def opened(cfg: CacheConfig, hybrid: HybridModel, *, own: bool):
    """A HybridCache over `cfg`, its snapshots in a states cache of their own when `own`
    (both caches are flushed, so L2 and L3 hold everything, and closed at the end)."""
    async with AsyncExitStack() as stack:
        cache = await stack.enter_async_context(HiCache(cfg))
        states = None
        if own:
            states = await stack.enter_async_context(HiCache(state_config(cfg, hybrid)))
        yield HybridCache(cache, hybrid, states=states)


async def push_down(hc: HybridCache, *, clear: bool) -> None:
    for c in (hc.cache, hc.states):
        if c is not None:
            await c.flush()
            if clear:
                await c.clear(["device"])


CASES = [(kind, False) for kind in KINDS] + [("bamba", True), ("qwen3next", True)]


@pytest.mark.parametrize(
    ("kind", "own"), CASES, ids=[f"{k}-{'own' if o else 'pool'}" for k, o in CASES]
)
def test_a_prefix_resumes_exactly_from_l2_and_from_l3(kind, own, tmp_path):
    model = tiny_model(kind)
    adapter = Adapter(model)
    gen = torch.Generator().manual_seed(7)
    first = torch.randint(0, VOCAB, (48,), generator=gen).tolist()
    second = first + torch.randint(0, VOCAB, (16,), generator=gen).tolist()
    cfg = adapter.config(storage=f"file:{tmp_path}")

    async def main():
        async with opened(cfg, adapter.hybrid, own=own) as hc:
            await adapter.serve(hc, "first", first)
            await push_down(hc, clear=True)  # everything to L2
            from_l2 = await adapter.serve(hc, "second", second)
            await push_down(hc, clear=False)
        async with opened(cfg, adapter.hybrid, own=own) as hc:  # only L3 holds anything
            fetched = await hc.prefetch("second", second)
            from_l3 = await adapter.serve(hc, "second", second)
        return from_l2, fetched, from_l3

    from_l2, fetched, from_l3 = run_virtual(main)
    full = full_logits(model, second)
    # L2 holds `first` (48 tokens): its end. L3 holds all of `second` (64): the deepest point
    # every group can resume from below its last token: 60 (a page), or 56 (a snapshot).
    deepest = 56 if adapter.recurrent_layers else 60
    for (hit, logits, _kv, _states), h in ((from_l2, 48), (from_l3, deepest)):
        assert hit.length == h
        assert error(logits, full[h:]) <= EXACT
    assert (fetched.kv_len, fetched.snapshot) == (64, 56 if adapter.recurrent_layers else None)
    if adapter.recurrent_layers:  # both snapshots were read back from L2 (L3 prefetched there)
        assert from_l2[0].state_tier == from_l3[0].state_tier == "host"

    # Negative controls on what the cache handed back from L3.
    hit, _, kv, states = from_l3
    h = hit.length
    if adapter.recurrent_layers:  # a snapshot from another point (the grid point before)
        wrong = prefill_snapshots(model, second, [h - GRID]).states[h - GRID]
        assert error(resume_logits(model, second, h, kv, wrong), full[h:]) >= WRONG
    sliding = [i for i, s in enumerate(adapter.specs) if s.kind == "sliding"]
    if sliding:  # the window's oldest token zeroed in every sliding layer
        window = adapter.specs[sliding[0]].window
        damaged = {i: (k.clone(), v.clone()) for i, (k, v) in kv.items()}
        for i in sliding:
            damaged[i][0][h - window + 1] = 0
            damaged[i][1][h - window + 1] = 0
        assert error(resume_logits(model, second, h, damaged, states), full[h:]) >= WRONG
