"""KV geometry: how many bytes one token occupies, and in which shape.

A geometry is a frozen value. MHA (including GQA/MQA, by head count) keeps a K and a V row per
token and layer; MLA keeps one latent row of width `kv_lora_rank + qk_rope_head_dim`. Transfers
see both through the same lens: `components` rows (2 for MHA, 1 for MLA) of `row_heads` x
`row_dim` elements per token and layer. A geometry of 0 layers holds no bytes: its pages are
tokens alone (docs/hybrid.md, "Models with no layer kept as pages").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
"""The KV dtypes the library accepts, by name."""


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called `name`; ValueError naming the accepted names otherwise."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The name under which `dtype` is accepted (inverse of `dtype_from_name`)."""
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; expected one of {sorted(DTYPES)}")


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _layers(value: int) -> None:
    """0 layers is a pool of pages with no K/V (a model whose every layer keeps its cache
    elsewhere, such as a pure state-space model's snapshots): pages are tokens alone."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"layers must be an int >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class MHAGeometry:
    """Multi-head attention KV: per layer a K and a V buffer of shape (tokens, heads, head_dim).
    `heads` is the number of KV heads held by this rank (GQA/MQA: fewer than query heads)."""

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    kind: ClassVar[str] = "mha"

    def __post_init__(self) -> None:
        _layers(self.layers)
        _positive("heads", self.heads)
        _positive("head_dim", self.head_dim)
        dtype_name(self.dtype)

    @property
    def components(self) -> int:
        """Rows per token and layer: K and V."""
        return 2

    @property
    def row_heads(self) -> int:
        return self.heads

    @property
    def row_dim(self) -> int:
        return self.head_dim

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """2 x layers x heads x head_dim x itemsize."""
        return 2 * self.layers * self.heads * self.head_dim * self.itemsize

    def spec(self) -> str:
        """The spec string `parse_geometry` reads back into an equal geometry."""
        return f"mha:{self.layers}:{self.heads}:{self.head_dim}:{dtype_name(self.dtype)}"


@dataclass(frozen=True, slots=True)
class MLAGeometry:
    """Multi-head latent attention KV: per layer one latent buffer (tokens, 1, rank + rope)."""

    layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype

    kind: ClassVar[str] = "mla"

    def __post_init__(self) -> None:
        _layers(self.layers)
        _positive("kv_lora_rank", self.kv_lora_rank)
        _positive("qk_rope_head_dim", self.qk_rope_head_dim)
        dtype_name(self.dtype)

    @property
    def components(self) -> int:
        """Rows per token and layer: the latent row."""
        return 1

    @property
    def row_heads(self) -> int:
        return 1

    @property
    def row_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """layers x (kv_lora_rank + qk_rope_head_dim) x itemsize."""
        return self.layers * self.row_dim * self.itemsize

    def spec(self) -> str:
        return (
            f"mla:{self.layers}:{self.kv_lora_rank}:{self.qk_rope_head_dim}:"
            f"{dtype_name(self.dtype)}"
        )


Geometry = MHAGeometry | MLAGeometry


def parse_geometry(spec: str) -> Geometry:
    """Read `mha:LAYERS:HEADS:DIM:DTYPE` or `mla:LAYERS:RANK:ROPE:DTYPE`.

    Raises ValueError naming the part that is wrong."""
    parts = spec.strip().split(":")
    if len(parts) != 5:
        raise ValueError(
            f"geometry spec {spec!r} must have 5 fields: "
            "mha:LAYERS:HEADS:DIM:DTYPE or mla:LAYERS:RANK:ROPE:DTYPE"
        )
    kind, *numbers, dtype = parts
    names = {
        "mha": ("layers", "heads", "head_dim"),
        "mla": ("layers", "kv_lora_rank", "qk_rope_head_dim"),
    }
    if kind not in names:
        raise ValueError(f"geometry spec {spec!r}: kind must be 'mha' or 'mla', got {kind!r}")
    values = []
    for field, text in zip(names[kind], numbers):
        try:
            values.append(int(text))
        except ValueError:
            raise ValueError(
                f"geometry spec {spec!r}: {field} must be an int, got {text!r}"
            ) from None
    torch_dtype = dtype_from_name(dtype)
    first, second, third = values
    if kind == "mha":
        return MHAGeometry(first, second, third, dtype=torch_dtype)
    return MLAGeometry(first, second, third, dtype=torch_dtype)
