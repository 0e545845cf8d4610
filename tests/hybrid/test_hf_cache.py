"""Hybrid models through hicache, end to end: a tiny random-weight model's prefill is
stored through `HybridCache` (K/V of every attention layer in the pool, recurrent snapshots
as state chains), pushed down to L2, and to L3 where a second instance over the same file
store reads it; the hit is loaded back and fed to the model as its cache, and the suffix's
logits must equal a full forward's within 1e-5 (fp32). In the same tests, a wrong cache is
caught: a snapshot from another point, or the window's oldest token zeroed. Recurrent models
run twice: snapshots in the K/V pools, and in a states cache of their own (`state_config`)."""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import numpy as np
import torch

from hicache import CacheConfig, HiCache
from hicache.assembly import storage_namespace
from hicache.hybrid import (
    FullAttention,
    HybridCache,
    HybridModel,
    LayerGroup,
    NoCache,
    Recurrent,
    SlidingWindow,
    state_config,
)
from hicache.testing import run_virtual
from tests.hybrid.hf_models import (
    FAMILIES,
    KINDS,
    NO_POOL,
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
    """Moves one model's cache between its tensors and the cache's pool and snapshot bytes.
    `windowed`: the sliding layers are declared with a grid, so only their window is kept, in
    each snapshot (the last WINDOW - 1 tokens' K and V of every sliding layer, zero-padded in
    front, before the recurrent states)."""

    def __init__(self, model, *, windowed: bool = False):
        self.model = model
        self.specs = layer_specs(model)
        attention = any(s.has_kv for s in self.specs)  # Mamba2 has none: its geometry is moot
        self.kv_heads, self.head_dim = attention_geometry(model) if attention else (1, 1)
        self.shapes = state_shapes(model) if self.recurrent_layers else {}
        state_bytes = len(self.recurrent_layers) * sum(
            int(np.prod(s)) * 4 for s in self.shapes.values()
        )
        # declared by the model's own layer numbers: a layer with K/V and a state (Falcon-H1,
        # Zamba2) is in a FullAttention group and in the Recurrent one, an MLP-only layer
        # (Nemotron-H) in NoCache
        groups: list[LayerGroup] = []
        full = tuple(i for i, s in enumerate(self.specs) if s.kind in ("full", "hybrid"))
        sliding = [i for i, s in enumerate(self.specs) if s.window is not None]
        self.window = self.specs[sliding[0]].window if sliding else 0
        self.windowed_layers = sliding if windowed else []
        if full:
            groups.append(FullAttention(full))
        if sliding and windowed:
            tail = (self.window - 1) * len(sliding) * 2 * self.kv_heads * self.head_dim * 4
            groups.append(SlidingWindow(tuple(sliding), self.window, tail, GRID))
        elif sliding:
            groups.append(SlidingWindow(tuple(sliding), self.window))
        if self.recurrent_layers:
            groups.append(Recurrent(tuple(self.recurrent_layers), state_bytes, GRID))
        if none := tuple(i for i, s in enumerate(self.specs) if s.kind == "none"):
            groups.append(NoCache(none))
        self.hybrid = HybridModel(tuple(groups), PAGE)

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.specs) if s.has_state]

    def config(self, **overrides) -> CacheConfig:
        kv = f"mha:{len(self.hybrid.pool_layers)}:{self.kv_heads}:{self.head_dim}:float32"
        base = dict(
            kv=kv, page_size=PAGE, device_tokens=256, host_tokens=1024, deterministic=True,
            write_policy="write_through", model_id="tiny-hybrid", prefetch_policy="wait_complete",
            prefetch_threshold=2 * PAGE,
        )  # fmt: skip
        base.update(overrides)
        return CacheConfig(**base)

    def pack(self, states: dict[int, dict[str, torch.Tensor]], kv, point: int) -> bytes:
        """The snapshot at `point`: windowed sliding layers' last tokens, then the states."""
        parts = []
        tail = self.window - 1
        for i in self.windowed_layers:
            for t in kv[i]:
                padded = torch.zeros(tail, self.kv_heads, self.head_dim)
                seg = t[max(0, point - tail) : point]
                padded[tail - len(seg) :] = seg
                parts.append(padded.reshape(-1))
        parts += [
            states[i][name].reshape(-1) for i in self.recurrent_layers for name in self.shapes
        ]
        return torch.cat(parts).numpy().tobytes() if parts else b""

    def unpack(self, blob: bytes | None, h: int):
        """(recurrent states, K/V of the windowed sliding layers as (h, heads, dim) tensors,
        zero outside the window) of the snapshot at h."""
        if not self.hybrid.stateful:
            return {}, {}
        flat = torch.frombuffer(bytearray(blob), dtype=torch.float32)
        states, kv, at = {}, {}, 0
        tail = self.window - 1
        n = tail * self.kv_heads * self.head_dim
        for i in self.windowed_layers:
            pair = []
            for _ in range(2):
                full = torch.zeros(h, self.kv_heads, self.head_dim)
                take = min(h, tail)
                window = flat[at : at + n].reshape(tail, self.kv_heads, self.head_dim)
                full[h - take :] = window[tail - take :]
                pair.append(full)
                at += n
            kv[i] = tuple(pair)
        for i in self.recurrent_layers:
            states[i] = {}
            for name, shape in self.shapes.items():
                size = int(np.prod(shape))
                states[i][name] = flat[at : at + size].reshape(shape).clone()
                at += size
        return states, kv

    def write_kv(self, pool, slots, kv, first: int) -> None:
        """The model (on the CPU) writes its K/V into the pool, wherever the pool lives."""
        index = torch.as_tensor(np.array(slots), dtype=torch.int64, device=pool.device)
        for p, layer in enumerate(self.hybrid.pool_layers):
            k, v = kv[layer]
            pool.k_buffer(p)[index] = k[first : first + len(slots)].to(pool.device)
            pool.v_buffer(p)[index] = v[first : first + len(slots)].to(pool.device)

    def read_kv(self, pool, slots) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        index = torch.as_tensor(np.array(slots), dtype=torch.int64, device=pool.device)
        return {
            layer: (pool.k_buffer(p)[index].cpu(), pool.v_buffer(p)[index].cpu())
            for p, layer in enumerate(self.hybrid.pool_layers)
        }

    async def serve(self, hc: HybridCache, rid: str, tokens: list[int]):
        """Run one request as an engine would: resume from the hit (the logits of the rest
        come from the restored cache), store K/V and snapshots. Returns (hit, logits of
        tokens[hit:], the K/V and states it resumed from)."""
        hit = await hc.match(rid, tokens)
        h = hit.length
        kv = self.read_kv(hc.cache.device_pool, hit.device_slots)
        states, window = self.unpack(hit.state, h) if h else ({}, {})
        kv.update(window)
        logits = resume_logits(self.model, tokens, h, kv, states) if h else None
        points = hc.model.snapshot_points(len(tokens))
        snaps = prefill_snapshots(self.model, tokens, points)
        fresh = await hc.allocate(rid, len(tokens) - h)
        self.write_kv(hc.cache.device_pool, fresh, snaps.kv, first=h)
        packed = {p: self.pack(snaps.states[p], snaps.kv, p) for p in points if p > h}
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


# (model, snapshots in a states cache of their own, sliding layers kept as windows only)
CASES = [(kind, False, False) for kind in KINDS] + [
    ("bamba", True, False),
    ("qwen3next", True, False),
    ("gemma3", False, True),
    ("gemma3", True, True),
    *((family, False, False) for family in FAMILIES),
    ("falconh1", True, False),
    ("nemotronh", True, False),
    # no layer kept as pages: the pool has 0 layers, its pages are tokens alone, and the
    # snapshots (states, or every sliding layer's window) are all there is to resume from
    ("mamba2", True, False),
    ("mistral", True, True),
    ("zaya", True, True),
]
IDS = [f"{k}-{'own' if o else 'pool'}{'-windowed' if w else ''}" for k, o, w in CASES]


@pytest.mark.parametrize(("kind", "own", "windowed"), CASES, ids=IDS)
def test_a_prefix_resumes_exactly_from_l2_and_from_l3(kind, own, windowed, tmp_path):
    model = tiny_model(kind)
    adapter = Adapter(model, windowed=windowed)
    gen = torch.Generator().manual_seed(7)
    first = torch.randint(0, VOCAB, (48,), generator=gen).tolist()
    second = first + torch.randint(0, VOCAB, (16,), generator=gen).tolist()
    cfg = adapter.config(storage=f"file:{tmp_path}")
    if (windowed or kind in FAMILIES) and not own:  # a snapshot is 11-12 pool pages: room
        # for a request's six (Falcon-H1's four Mamba2 states, 42 KiB, are 11 pages)
        cfg = adapter.config(storage=f"file:{tmp_path}", device_tokens=1024, host_tokens=2048)

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
    stateful = bool(adapter.hybrid.stateful)  # recurrent or windowed: a hit needs a snapshot
    deepest = 56 if stateful else 60
    for (hit, logits, _kv, _states), h in ((from_l2, 48), (from_l3, deepest)):
        assert hit.length == h
        assert error(logits, full[h:]) <= EXACT
    assert (fetched.kv_len, fetched.snapshot) == (64, 56 if stateful else None)
    if stateful:  # both snapshots were read back from L2 (L3 prefetched there)
        assert from_l2[0].state_tier == from_l3[0].state_tier == "host"
    if windowed:  # the pool holds the full layers alone: the sliding ones live in snapshots
        full_layers = tuple(i for i, s in enumerate(adapter.specs) if s.kind == "full")
        assert adapter.hybrid.pool_layers == full_layers == ((2,) if kind == "gemma3" else ())

    # Negative controls on what the cache handed back from L3.
    hit, _, kv, states = from_l3
    h = hit.length
    if adapter.recurrent_layers:  # a snapshot from another point (the grid point before)
        wrong = prefill_snapshots(model, second, [h - GRID]).states[h - GRID]
        assert error(resume_logits(model, second, h, kv, wrong), full[h:]) >= WRONG
    if windowed:  # the window kept at the grid point before, handed back as if at h
        before = prefill_snapshots(model, second, [h - GRID])
        packed = adapter.pack(before.states.get(h - GRID, {}), before.kv, h - GRID)
        _, shifted = adapter.unpack(packed, h)
        assert error(resume_logits(model, second, h, {**kv, **shifted}, states), full[h:]) >= WRONG
    both = [i for i, s in enumerate(adapter.specs) if s.kind == "hybrid"]
    if both:  # a layer with a state still needs its K/V: the last token's zeroed in one
        damaged = {i: (k.clone(), v.clone()) for i, (k, v) in kv.items()}
        damaged[both[-1]][0][h - 1] = 0
        damaged[both[-1]][1][h - 1] = 0
        assert error(resume_logits(model, second, h, damaged, states), full[h:]) >= WRONG
    if kind == "nemotronh":  # the MLP-only layer is declared and keeps nothing
        assert adapter.hybrid.pool_layers == (1,) and 2 not in kv and 2 not in states
    sliding = [i for i, s in enumerate(adapter.specs) if s.window is not None]
    if sliding:  # the window's oldest token zeroed in every sliding layer
        window = adapter.specs[sliding[0]].window
        damaged = {i: (k.clone(), v.clone()) for i, (k, v) in kv.items()}
        for i in sliding:
            damaged[i][0][h - window + 1] = 0
            damaged[i][1][h - window + 1] = 0
        assert error(resume_logits(model, second, h, damaged, states), full[h:]) >= WRONG


def flip_new_files(directory: Path, before: set[Path]) -> int:
    """Flip a byte in the middle of every file under `directory` not in `before` (values
    written since); how many."""
    new = sorted(p for p in directory.rglob("*") if p.is_file() and p not in before)
    for path in new:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    return len(new)


@pytest.mark.parametrize("kind", NO_POOL)
def test_a_model_with_no_layer_kept_as_pages_resumes_exactly_from_every_tier(kind, tmp_path):
    """Mamba2 (every layer recurrent) and Mistral-v0.1-like (every layer sliding, windowed):
    the K/V cache's pool has 0 layers and no byte, its pages are the tokens the snapshots are
    found by. A hit from L1, from L2 after clearing L1, and from L3 in a second instance is
    exact; a snapshot poisoned in L3 is refused (the hit falls back to the one before, still
    exact), and a snapshot of another point, resumed from, moves the logits."""
    model = tiny_model(kind)
    adapter = Adapter(model, windowed=True)
    assert adapter.hybrid.pool_layers == () and adapter.hybrid.stateful
    gen = torch.Generator().manual_seed(11)
    first = torch.randint(0, VOCAB, (48,), generator=gen).tolist()
    second = first + torch.randint(0, VOCAB, (16,), generator=gen).tolist()
    cfg = adapter.config(storage=f"file:{tmp_path}")
    states_dir = tmp_path / storage_namespace(state_config(cfg, adapter.hybrid)).digest

    async def main():
        async with opened(cfg, adapter.hybrid, own=True) as hc:
            pool, host = hc.cache.device_pool, hc.cache.host_pool
            sizes = (pool.geometry.layers, pool.geometry.bytes_per_token, host.nbytes)
            await adapter.serve(hc, "first", first)
            await push_down(hc, clear=False)
            before = {p for p in tmp_path.rglob("*") if p.is_file()}
            from_l1 = await adapter.serve(hc, "second", second)  # snapshots at 56 and 64 too
            await push_down(hc, clear=True)
            from_l2 = await adapter.serve(hc, "again", second)
            await push_down(hc, clear=False)
        async with opened(cfg, adapter.hybrid, own=True) as hc:
            await hc.prefetch("second", second)
            from_l3 = await adapter.serve(hc, "second", second)
        poisoned = flip_new_files(states_dir, before)  # the snapshots at 56 and 64
        async with opened(cfg, adapter.hybrid, own=True) as hc:
            await hc.prefetch("second", second)
            after_poison = await adapter.serve(hc, "second", second)
        return sizes, from_l1, from_l2, from_l3, poisoned, after_poison

    sizes, from_l1, from_l2, from_l3, poisoned, after_poison = run_virtual(main)
    assert sizes == (0, 0, 0)  # no K/V kept, none allocated: L1 and L2 pools hold no byte
    full = full_logits(model, second)
    tiers = ((from_l1, 48, "device"), (from_l2, 56, "host"), (from_l3, 56, "host"))
    for (hit, logits, _, _), h, tier in (*tiers, (after_poison, 48, "host")):
        assert (hit.length, hit.state_tier) == (h, tier), hit
        assert len(hit.device_slots) == h  # token pages, locked like any hit's
        assert error(logits, full[h:]) <= EXACT
    assert poisoned == 2
    hit, _, kv, _ = from_l3
    h = hit.length
    before = prefill_snapshots(model, second, [h - GRID])
    wrong_states, shifted = adapter.unpack(
        adapter.pack(before.states[h - GRID], before.kv, h - GRID), h
    )
    wrong = resume_logits(model, second, h, {**kv, **shifted}, wrong_states)
    assert error(wrong, full[h:]) >= WRONG
