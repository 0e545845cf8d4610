"""What both halves derive alike from vLLM's config: the page geometry, the L3 namespace,
where a salted request's page hash chain starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hicache.backends.keys import KV_DTYPES, Namespace
from hicache.types import PageHash


@dataclass(frozen=True, slots=True)
class Geometry:
    """What both sides derive alike from vLLM's KV cache config."""

    block_size: int  # tokens per vLLM block = hicache page
    layers: tuple[str, ...]  # attention layers, in vLLM's group order
    page_bytes: int  # one block of every layer, one worker's shard
    kv: str  # hicache kv spec, for the L3 namespace
    layout: str  # the byte order of a stored page


def geometry_of(vllm_config: Any, kv_cache_config: Any) -> Geometry:
    """Geometry of a model with one uniform attention KV cache group. Raises ValueError for
    what this connector does not support (hybrid models: several groups)."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ValueError(
            f"HiCacheConnector supports one KV cache group (uniform attention), got {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    layers = tuple(groups[0].layer_names)
    block_size = int(spec.block_size)
    heads = int(getattr(spec, "num_kv_heads", 1))
    head_size = int(getattr(spec, "head_size", 0))
    dtype = str(getattr(spec, "dtype", "")).removeprefix("torch.")
    if dtype not in KV_DTYPES:
        dtype = "uint8"  # quantized caches: the namespace still separates them (layout)
    kind = "mla" if type(spec).__name__.startswith("MLA") else "mha"
    page_bytes = int(spec.page_size_bytes) * len(layers)
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "?"))
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    layout = (
        f"vllm:{device}:{getattr(kv_cache_config, 'kv_cache_layout', None)}:"
        f"{cache_dtype}:{type(spec).__name__}:{page_bytes}"
    )
    kv = f"{kind}:{len(layers)}:{max(heads, 1)}:{max(head_size, 1)}:{dtype}"
    return Geometry(block_size, layers, page_bytes, kv, layout)


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
    from hicache.radix.structure import salt_seed

    return salt_seed(salt.encode())
