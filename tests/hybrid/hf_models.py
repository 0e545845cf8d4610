"""Tiny random-weight hybrid models (Hugging Face transformers 5.19) and their caches as plain tensors.

The cache library must restore hybrid-model caches exactly: per-token K/V for attention layers (full
and sliding window alike) and per-position snapshots of recurrent layers' states (Mamba2, gated
delta-net). This module is the test-side model harness for that: it turns a transformers cache into
plain per-token tensors (`prefill_snapshots`) and builds, from such tensors, the cache a hit of
length h provides (`resume_logits`), so a test can compare the resumed logits with a full forward.

Everything is fp32 on CPU with eager attention and transformers' pure-torch fallbacks (neither
`kernels`, `mamba_ssm` nor `fla` is needed). The layouts, batch dimension dropped:
- K and V of an attention layer: (tokens, kv_heads, head_dim);
- a recurrent layer's state: {"conv": transformers' conv_states[0], "recurrent": recurrent_states[0]}.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    DynamicCache,
    FalconH1Config,
    FalconH1ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Mamba2Config,
    Mamba2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    PreTrainedModel,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    Zamba2Config,
    Zamba2ForCausalLM,
    ZayaConfig,
    ZayaForCausalLM,
)
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionLayer

KINDS = ("gemma3", "bamba", "qwen3next")
# Families whose layers are not one cache part each: Falcon-H1 (every layer attention and
# Mamba2), Zamba2 (Mamba2 layers, two of them also running a shared attention block),
# Nemotron-H (an MLP-only layer, no cache).
FAMILIES = ("falconh1", "zamba2", "nemotronh")
# Models with no layer kept as pages when declared windowed: Mamba2 (every layer recurrent),
# Mistral-v0.1-like (every layer sliding) and a Samba-like ZAYA (every layer sliding window
# attention beside a recurrent state of its own: a conv state and the previous token's value
# projection; no full attention).
NO_POOL = ("mamba2", "mistral", "zaya")
WINDOW = 16  # gemma3's sliding window: a layer sees the last WINDOW tokens, itself included
VOCAB = 256
# All attention layers (full and sliding) of every kind share this geometry.
KV_HEADS = 2
HEAD_DIM = 16
# A wider init than transformers' default (0.02) so that a wrong cache moves the logits visibly.
INIT_RANGE = 0.05


@dataclass
class LayerSpec:
    """What the cache library keeps for one decoder layer."""

    # "full" | "sliding" | "recurrent" | "hybrid" (full and recurrent) | "sliding_hybrid"
    # (sliding and recurrent) | "none"
    kind: str
    window: int | None = None  # sliding layers: tokens seen by a query, itself included

    @property
    def has_kv(self) -> bool:
        return self.kind in ("full", "sliding", "hybrid", "sliding_hybrid")

    @property
    def has_state(self) -> bool:
        return self.kind in ("recurrent", "hybrid", "sliding_hybrid")


@dataclass
class Snapshots:
    """A prefill's cache as plain tensors (fp32, contiguous, batch dimension dropped).

    kv[layer] = (K, V), each (tokens, kv_heads, head_dim), for every attention layer and position;
    states[point][layer] = {name: tensor} for every recurrent layer: the state after token point - 1.
    """

    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    states: dict[int, dict[int, dict[str, torch.Tensor]]] = field(default_factory=dict)


def _config(kind: str) -> Any:
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 512,
        "initializer_range": INIT_RANGE,
        "attn_implementation": "eager",
    }
    if kind == "gemma3":
        return Gemma3TextConfig(
            **common,
            head_dim=HEAD_DIM,
            query_pre_attn_scalar=HEAD_DIM,
            sliding_window=WINDOW,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
        )
    if kind == "bamba":
        # head_dim = hidden_size / num_attention_heads = 16; mamba: 4 heads of 32 (expand 2)
        return BambaConfig(
            **common,
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=16,
        )
    if kind == "qwen3next":
        return Qwen3NextConfig(
            **common,
            head_dim=HEAD_DIM,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    if kind == "mistral":  # every layer sliding (Mistral 7B v0.1's layout)
        return MistralConfig(**common, head_dim=HEAD_DIM, sliding_window=WINDOW)
    if kind == "mamba2":  # every layer a Mamba2 mixer: no attention, no K/V
        return Mamba2Config(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=4,
            num_heads=4,
            head_dim=32,
            expand=2,
            n_groups=1,
            state_size=16,
            conv_kernel=4,
            chunk_size=16,
            initializer_range=INIT_RANGE,
        )
    if kind == "zaya":
        return ZayaConfig(
            **common,
            head_dim=HEAD_DIM,
            sliding_window=WINDOW,
            layer_types=["hybrid_sliding"] * 4,
            moe_intermediate_size=64,
            num_experts=2,
            router_hidden_size=32,
        )
    mamba = {"mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2}
    if kind == "falconh1":
        return FalconH1Config(
            **common,
            head_dim=HEAD_DIM,
            mamba_d_ssm=128,
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_chunk_size=16,
            **mamba,
        )
    if kind == "zamba2":
        # one shared attention block, run by layers 1 and 3 (each its own K/V); head_dim is
        # 2 * hidden_size / num_attention_heads = 32 here
        return Zamba2Config(
            **common,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
            n_mamba_heads=4,
            chunk_size=16,
            **mamba,
        )
    if kind == "nemotronh":
        common.pop("num_hidden_layers")  # the layer types say it
        return NemotronHConfig(
            **common,
            head_dim=HEAD_DIM,
            layers_block_type=["mamba", "attention", "mlp", "mamba"],
            ssm_state_size=16,
            mamba_num_heads=4,
            mamba_head_dim=32,
            n_groups=1,
            conv_kernel=4,
            expand=2,
            chunk_size=16,
        )
    raise ValueError(f"unknown kind {kind!r}; one of {KINDS + FAMILIES + NO_POOL}")


def tiny_model(kind: str, seed: int = 0) -> PreTrainedModel:
    """A 4-layer random-weight model of `kind`, fp32, eval mode, on CPU."""
    config = _config(kind)
    cls = {
        "gemma3": Gemma3ForCausalLM,
        "bamba": BambaForCausalLM,
        "qwen3next": Qwen3NextForCausalLM,
        "falconh1": FalconH1ForCausalLM,
        "zamba2": Zamba2ForCausalLM,
        "nemotronh": NemotronHForCausalLM,
        "mistral": MistralForCausalLM,
        "mamba2": Mamba2ForCausalLM,
        "zaya": ZayaForCausalLM,
    }
    torch.manual_seed(seed)
    model = cls[kind](config).to(torch.float32).eval()
    assert len(layer_types(model.config)) == 4
    return model


def layer_types(config: Any) -> list[str]:
    """transformers' name for each layer's cache; Mistral's config has none: every layer
    slides when `sliding_window` is set (what its DynamicCache builds)."""
    types = getattr(config, "layer_types", None)
    if types is None and getattr(config, "sliding_window", None):
        return ["sliding_attention"] * config.num_hidden_layers
    assert types is not None, f"{type(config).__name__} names no layer types"
    return list(types)


def layer_specs(model: PreTrainedModel) -> list[LayerSpec]:
    """One spec per decoder layer, from the config's layer_types."""
    config = model.config
    specs = []
    for layer_type in layer_types(config):
        if layer_type == "full_attention":
            specs.append(LayerSpec("full"))
        elif layer_type == "sliding_attention":
            specs.append(LayerSpec("sliding", config.sliding_window))
        elif layer_type == "linear_attention":
            specs.append(LayerSpec("recurrent"))
        elif layer_type == "hybrid_sliding":  # sliding attention's K/V and a state
            specs.append(LayerSpec("sliding_hybrid", config.sliding_window))
        elif layer_type == "hybrid":  # a Mamba2 state and full attention's K/V
            specs.append(LayerSpec("hybrid"))
        elif layer_type in ("mlp", "moe"):  # nothing kept between tokens
            specs.append(LayerSpec("none"))
        else:
            raise ValueError(f"unsupported layer type {layer_type!r}")
    return specs


def attention_geometry(model: PreTrainedModel) -> tuple[int, int]:
    """(kv_heads, head_dim), the same for every attention layer of these models."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads, head_dim


def state_shapes(model: PreTrainedModel) -> dict[str, tuple[int, ...]]:
    """Shapes (batch dimension dropped) of a recurrent layer's state tensors, all fp32.

    Read from a one-token forward, since they are whatever the model's mixer puts in the cache.
    """
    snaps = prefill_snapshots(model, [1], [1])
    layer_states = next(iter(snaps.states[1].values()), {})
    return {name: tuple(t.shape) for name, t in layer_states.items()}


def _forward(
    model: PreTrainedModel, tokens: list[int], start: int, cache: DynamicCache | None
) -> torch.Tensor:
    """Logits (len(tokens), vocab) of tokens at positions [start, start + len(tokens))."""
    ids = torch.tensor([tokens], dtype=torch.long)
    with torch.no_grad():
        if isinstance(model, Mamba2ForCausalLM):  # no positions; its cache is `cache_params`
            out = model(input_ids=ids, cache_params=cache, use_cache=cache is not None)
        else:  # explicit positions: Bamba would otherwise number a resumed chunk from 0
            positions = torch.arange(start, start + len(tokens)).unsqueeze(0)
            out = model(
                input_ids=ids,
                position_ids=positions,
                past_key_values=cache,
                use_cache=cache is not None,
            )
    return out.logits[0].float()


def full_logits(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """The reference: one forward over the whole prompt, no cache."""
    return _forward(model, tokens, 0, None)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).clone().contiguous()


def prefill_snapshots(model: PreTrainedModel, tokens: list[int], points: list[int]) -> Snapshots:
    """Prefill `tokens` in chunks that end at each of `points`; return every cache tensor needed.

    A sliding layer records its past (transformers' `activate_past_recording`): it keeps every
    token's K/V while the masks still apply the window, so K/V of all positions come back. A
    sliding layer that also keeps a state (ZAYA's) cannot record (its conv state would grow
    with the past too): its K/V is gathered from the window it keeps at each chunk's end, so
    positions older than every such window stay zero (no resume at a point reads them).
    """
    specs = layer_specs(model)
    assert all(0 < p <= len(tokens) for p in points)
    cache = DynamicCache(config=model.config)
    gathered: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, spec in enumerate(specs):
        if spec.window is not None and not spec.has_state:
            cache.layers[i].activate_past_recording()
    snaps = Snapshots()
    start = 0
    for end in [*sorted(set(points)), len(tokens)]:
        if end > start:
            _forward(model, tokens[start:end], start, cache)
            start = end
        for i, spec in enumerate(specs):
            if spec.window is not None and spec.has_state:
                layer = cache.layers[i]
                keys, values = (_plain(t[0].transpose(0, 1)) for t in (layer.keys, layer.values))
                empty = keys.new_zeros(len(tokens), *keys.shape[1:])
                k, v = gathered.setdefault(i, (empty, empty.clone()))
                k[end - len(keys) : end] = keys
                v[end - len(values) : end] = values
        if end in points:
            snaps.states[end] = {
                i: {
                    "conv": _plain(cache.layers[i].conv_states[0][0]),
                    "recurrent": _plain(cache.layers[i].recurrent_states[0][0]),
                }
                for i, spec in enumerate(specs)
                if spec.has_state
            }
    for i, spec in enumerate(specs):
        if i in gathered:
            snaps.kv[i] = gathered[i]
        elif spec.has_kv:
            layer = cache.layers[i]
            assert layer.keys.shape[-2] == len(tokens), (i, layer.keys.shape)
            snaps.kv[i] = (
                _plain(layer.keys[0].transpose(0, 1)),
                _plain(layer.values[0].transpose(0, 1)),
            )
    return snaps


def restore_cache(
    model: PreTrainedModel,
    h: int,
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
    states_at_h: dict[int, dict[str, torch.Tensor]],
) -> DynamicCache:
    """A fresh transformers cache holding what a hit of length h provides, and nothing more.

    Full layers get K/V of [0, h); sliding layers only [h - W + 1, h) (the tokens before are never
    read); recurrent layers the state after token h - 1.
    """
    cache = DynamicCache(config=model.config)
    for i, spec in enumerate(layer_specs(model)):
        layer = cache.layers[i]
        if spec.has_state:
            assert isinstance(layer, LinearAttentionLayer)
            conv, rec = states_at_h[i]["conv"], states_at_h[i]["recurrent"]
            # As in a prefill: sets the conv kernel size and has_previous_state.
            cache.update_conv_state(conv[None].clone(), i, conv_kernel_size=conv.shape[-1])
            cache.update_recurrent_state(rec[None].clone(), i)
        if not spec.has_kv:
            continue
        keys, values = kv[i]
        assert keys.shape[0] >= h and values.shape[0] >= h
        first = 0 if spec.window is None else max(h - spec.window + 1, 0)
        layer.update(
            keys[first:h].transpose(0, 1)[None].clone(),
            values[first:h].transpose(0, 1)[None].clone(),
        )
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length = h  # the absolute position the next token takes
    return cache


def resume_logits(
    model: PreTrainedModel,
    tokens: list[int],
    h: int,
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
    states_at_h: dict[int, dict[str, torch.Tensor]],
) -> torch.Tensor:
    """Logits (len(tokens) - h, vocab) of tokens[h:], computed from a cache hit of length h."""
    assert 0 < h < len(tokens)
    return _forward(model, tokens[h:], h, restore_cache(model, h, kv, states_at_h))
