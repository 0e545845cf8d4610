"""A tiny decoder-only transformer (float32, CPU) whose attention reads K/V from a paged pool.

It stands in for a serving engine's model in the example and the tests: embedding plus learned
positions, `layers` blocks of pre-norm multi-head attention and a SiLU MLP, RMSNorm, LM head,
all with random weights drawn from a seed.

The pool is anything with `k_buffer(layer)` and `v_buffer(layer)` returning `(tokens, heads,
head_dim)` float32 tensors (hicache's `DevicePool` or `ScratchKV` below). A request's K/V lives at
the slots the caller hands in: slot `slots[p]` holds position `p`.

Exactness: every token is computed on its own, with tensors whose shapes depend only on its
position, never on how many tokens or requests share the step. A token's float32 arithmetic is
then the same whether its prefix was computed just now, cached in L1, or loaded back from L2,
and whatever the batch: "prefix from cache + suffix" equals "all from scratch" bit for bit.
(Real engines get the same property from batch-invariant kernels; per-token loops are the
smallest honest way to get it here.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderConfig:
    layers: int = 2
    heads: int = 4
    head_dim: int = 16
    vocab: int = 256
    mlp_hidden: int = 128
    max_positions: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "head_dim", "vocab", "mlp_hidden", "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecoderConfig.{name}={value!r} must be a positive int")

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_spec(self) -> str:
        """The hicache `CacheConfig.kv` geometry this model's pool needs."""
        return f"mha:{self.layers}:{self.heads}:{self.head_dim}:float32"


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """One request's work in a forward step: compute `tokens` at positions `start, start+1, ...`.

    `slots[p]` is the pool slot of position p for every p < start + len(tokens): the prefix's
    K/V must already be there (or be landing: see `waits`), the chunk's own K/V is written.
    `waits` are load handles (`wait_async(layer)`) to await before attention reads a layer."""

    tokens: Sequence[int]
    start: int
    slots: torch.Tensor  # int64, 1-D
    waits: tuple = ()


class ScratchKV:
    """A private K/V pool for from-scratch reference runs (same interface as a DevicePool)."""

    def __init__(self, config: DecoderConfig, size: int) -> None:
        shape = (size, config.heads, config.head_dim)
        self._k = [torch.zeros(shape) for _ in range(config.layers)]
        self._v = [torch.zeros(shape) for _ in range(config.layers)]

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self._v[layer]


class TinyDecoder:
    """Weights are fixed at construction (seeded); `forward` mutates only the pool rows at the
    chunk's own slots."""

    def __init__(self, config: DecoderConfig | None = None) -> None:
        cfg = self.config = config or DecoderConfig()
        gen = torch.Generator().manual_seed(cfg.seed)
        d, f = cfg.hidden, cfg.mlp_hidden

        def weight(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) / shape[0] ** 0.5

        self.embed = torch.randn(cfg.vocab, d, generator=gen)
        self.positions = 0.1 * torch.randn(cfg.max_positions, d, generator=gen)
        self.blocks = [
            dict(
                attn_norm=1 + 0.1 * torch.randn(d, generator=gen),
                wqkv=weight(d, 3 * d),
                wo=weight(d, d),
                mlp_norm=1 + 0.1 * torch.randn(d, generator=gen),
                w1=weight(d, f),
                w2=weight(f, d),
            )
            for _ in range(cfg.layers)
        ]
        self.final_norm = 1 + 0.1 * torch.randn(d, generator=gen)
        self.lm_head = weight(d, cfg.vocab)
        self.scale = cfg.head_dim**-0.5

    @torch.inference_mode()
    async def forward(self, pool, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        """Run one step over every chunk; return each chunk's logits, `(len(tokens), vocab)`.

        Layer-major: layer i of every chunk runs before layer i+1 of any, so a load-back only
        has to have landed layer i when layer i starts (per-layer overlap)."""
        cfg = self.config
        for chunk in chunks:
            end = chunk.start + len(chunk.tokens)
            if end > cfg.max_positions:
                raise ValueError(f"position {end - 1} exceeds max_positions={cfg.max_positions}")
            if len(chunk.slots) < end:
                raise ValueError(
                    f"chunk needs {end} slots (prefix + tokens), got {len(chunk.slots)}"
                )
        hidden = [
            [self.embed[t] + self.positions[chunk.start + i] for i, t in enumerate(chunk.tokens)]
            for chunk in chunks
        ]
        for layer, block in enumerate(self.blocks):
            k_buf, v_buf = pool.k_buffer(layer), pool.v_buffer(layer)
            for chunk, states in zip(chunks, hidden):
                for handle in chunk.waits:
                    await handle.wait_async(layer)
                for i in range(len(states)):
                    states[i] = self._block(
                        block, states[i], chunk.start + i, chunk.slots, k_buf, v_buf
                    )
        return [
            torch.cat([_rms_norm(h, self.final_norm) @ self.lm_head for h in states])
            for states in hidden
        ]

    def _block(
        self,
        block: dict,
        h: torch.Tensor,
        pos: int,
        slots: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
    ) -> torch.Tensor:
        """One token through one block; writes its K/V at slots[pos]. h: (1, hidden)."""
        cfg = self.config
        h = h.reshape(1, cfg.hidden)
        q, k, v = (_rms_norm(h, block["attn_norm"]) @ block["wqkv"]).split(cfg.hidden, dim=1)
        slot = slots[pos : pos + 1]
        k_buf[slot] = k.reshape(1, cfg.heads, cfg.head_dim)
        v_buf[slot] = v.reshape(1, cfg.heads, cfg.head_dim)
        seen = slots[: pos + 1]
        keys, values = k_buf[seen], v_buf[seen]  # (pos+1, heads, head_dim)
        scores = torch.einsum("hd,thd->ht", q.reshape(cfg.heads, cfg.head_dim), keys) * self.scale
        attn = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), values).reshape(1, cfg.hidden)
        h = h + attn @ block["wo"]
        x = _rms_norm(h, block["mlp_norm"])
        return h + torch.nn.functional.silu(x @ block["w1"]) @ block["w2"]

    async def reference_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits for every position of `tokens`, computed from scratch in a private pool."""
        pool = ScratchKV(self.config, len(tokens))
        slots = torch.arange(len(tokens), dtype=torch.int64)
        (logits,) = await self.forward(pool, [Chunk(tokens=tokens, start=0, slots=slots)])
        return logits


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight
