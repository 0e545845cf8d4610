"""What both halves derive alike from vLLM's config: the page geometry (one part per KV cache
group), the L3 namespace, where a salted request's page hash chain starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache.backends.keys import KV_DTYPES, Namespace
from hicache.radix.hashes import salt_seed
from hicache.types import PageHash

NULL_BLOCK = 0
"""vLLM's null block: the id its hybrid manager puts where a group keeps no block (a sliding
window group's blocks older than its window). Never a request's own block."""


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """One vLLM KV cache group's part of a stored page."""

    kind: str  # "full" or "sliding"
    layers: tuple[str, ...]  # vLLM's layer names, in vLLM's group order
    page_bytes: int  # one block of every layer of the group, one worker's shard
    window: int = 0  # sliding: tokens a query sees (itself included)

    @property
    def nullable(self) -> bool:
        """vLLM may hand NULL_BLOCK for this group inside a request's range."""
        return self.kind == "sliding"


@dataclass(frozen=True, slots=True)
class Geometry:
    """What both sides derive alike from vLLM's KV cache config."""

    block_size: int  # tokens per vLLM block = hicache page
    layers: tuple[str, ...]  # attention layers, group after group, in vLLM's group order
    page_bytes: int  # one block of every layer, one worker's shard
    kv: str  # hicache kv spec, for the L3 namespace
    layout: str  # the byte order of a stored page
    groups: tuple[GroupGeometry, ...] = ()  # empty: one full-attention group of `layers`

    @property
    def parts(self) -> tuple[GroupGeometry, ...]:
        """The stored page's parts, one per vLLM group, in vLLM's group order."""
        return self.groups or (GroupGeometry("full", self.layers, self.page_bytes),)

    @property
    def hybrid(self) -> bool:
        """More than one KV cache group (vLLM's hybrid KV cache manager)."""
        return len(self.parts) > 1


_KINDS = {"FullAttentionSpec": "full", "MLAAttentionSpec": "full", "SlidingWindowSpec": "sliding"}


def _group_geometry(group: Any) -> GroupGeometry:
    spec = group.kv_cache_spec
    kind = _KINDS.get(type(spec).__name__)
    if kind is None:
        raise ValueError(
            f"HiCacheConnector: KV cache group of {type(spec).__name__} (layers "
            f"{list(group.layer_names)[:3]}...) is not supported: full attention and sliding "
            "window groups are (docs/vllm.md, Hybrid models)"
        )
    layers = tuple(group.layer_names)
    window = int(getattr(spec, "sliding_window", 0) or 0) if kind == "sliding" else 0
    return GroupGeometry(kind, layers, int(spec.page_size_bytes) * len(layers), window)


def geometry_of(vllm_config: Any, kv_cache_config: Any) -> Geometry:
    """Geometry of vLLM's KV cache groups: one full attention group, or (vLLM's hybrid KV
    cache manager) full attention and sliding window groups of one block size. Raises
    ValueError for what this connector does not support, naming it."""
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise ValueError("HiCacheConnector: the model has no KV cache group (attention-free)")
    parts = tuple(_group_geometry(g) for g in groups)
    specs = [g.kv_cache_spec for g in groups]
    sizes = {int(s.block_size) for s in specs}
    if len(sizes) != 1:
        raise ValueError(f"HiCacheConnector: KV cache groups of different block sizes {sizes}")
    spec = specs[0]
    block_size = sizes.pop()
    layers = tuple(name for p in parts for name in p.layers)
    heads = int(getattr(spec, "num_kv_heads", 1))
    head_size = int(getattr(spec, "head_size", 0))
    dtype = str(getattr(spec, "dtype", "")).removeprefix("torch.")
    if dtype not in KV_DTYPES:
        dtype = "uint8"  # quantized caches: the namespace still separates them (layout)
    kind = "mla" if type(spec).__name__.startswith("MLA") else "mha"
    page_bytes = sum(p.page_bytes for p in parts)
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "?"))
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    layout = (
        f"vllm:{device}:{getattr(kv_cache_config, 'kv_cache_layout', None)}:"
        f"{cache_dtype}:{type(spec).__name__}:{page_bytes}"
    )
    if len(parts) > 1:  # hybrid: the page's parts, so no other grouping reads these values
        layout += ":" + ",".join(f"{p.kind}{p.window or ''}x{len(p.layers)}" for p in parts)
    kv = f"{kind}:{len(layers)}:{max(heads, 1)}:{max(head_size, 1)}:{dtype}"
    return Geometry(block_size, layers, page_bytes, kv, layout, parts if len(parts) > 1 else ())


def namespace_of(geometry: Geometry, model_id: str, *, rank: int, tp_size: int) -> Namespace:
    """The L3 namespace of one worker's shard (the scheduler probes rank 0's)."""
    return Namespace(
        model=model_id,
        kv=geometry.kv,
        page_size=geometry.block_size,
        rank=rank,
        tp_size=tp_size,
        layout=geometry.layout,
    )


def salt_prior(salt: str | None) -> PageHash | None:
    """Where a salted request's page hash chain starts: hicache's `salt_seed`, so keys equal
    those of an embedded HiCache matching the same tokens under the same salt."""
    if not salt:
        return None
    return salt_seed(salt.encode())
