"""Where one page of an SGLang host pool lies in memory, and the namespace its values go under.

A stored value is SGLang's *flat data page* of the pool (`get_data_page(index, flat=True)`:
for MHA the K of every layer, then the V; the order within follows the pool's layout), so the
zero-copy calls (`batch_get_v1` / `batch_set_v1`, v2) and the legacy ones (`batch_get` into
SGLang's dummy pages, `batch_set` of flat pages) store the same bytes and read each other's
values. Where `get_data_page(index, flat=False)` is a view of the pool's buffer (every layout
of SGLang's MHA and MLA host pools: `layer_first`, `page_first`, `page_first_direct`,
`page_head`), a page is handed to hicache's backends as the byte ranges of that view, in
order, and read and written in place. Other pools (a Mamba state pool builds its page by
concatenation) go through a copy: `get_data_page` to write, SGLang's
`set_from_flat_data_page` after a verified read.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
from typing import Any, cast

import torch

from hicache.backends.keys import KV_DTYPES, Namespace


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor."""
    if not t.is_contiguous():
        raise ValueError("a page tensor must be contiguous")
    return memoryview(cast(Any, t.view(-1).view(torch.uint8).numpy())).cast("B")


class PageMap:
    """The byte ranges of one host pool's pages (see the module docstring)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        dummy = pool.get_dummy_flat_data_page()
        self.page_bytes = int(dummy.numel() * dummy.element_size())
        self.zero_copy = False
        self._whole: memoryview | None = None
        self._storage_ptr = 0
        self._shape: tuple[int, ...] = ()
        self._strides: tuple[int, ...] = ()
        self._spans: list[tuple[int, int]] = []
        try:
            first = pool.get_data_page(0, flat=False)
            again = pool.get_data_page(0, flat=False)
        except (TypeError, ValueError, NotImplementedError, IndexError):
            return
        if (
            isinstance(first, torch.Tensor)
            and first.device.type == "cpu"
            and first.untyped_storage().data_ptr() == again.untyped_storage().data_ptr()
            and first.numel() * first.element_size() == self.page_bytes
        ):
            storage = first.untyped_storage()
            self._storage_ptr = storage.data_ptr()
            array = (ctypes.c_ubyte * storage.nbytes()).from_address(self._storage_ptr)
            self._whole = memoryview(array).cast("B")
            self._learn(first)
            self.zero_copy = True

    def _learn(self, view: torch.Tensor) -> None:
        """The page's contiguous runs relative to its first element, in the flat order."""
        shape, strides, item = tuple(view.shape), tuple(view.stride()), view.element_size()
        # the longest suffix of dimensions that is C-contiguous is one run
        run, expected, cut = 1, 1, len(shape)
        for d in range(len(shape) - 1, -1, -1):
            if shape[d] != 1 and strides[d] != expected:
                break
            expected *= shape[d]
            run *= shape[d]
            cut = d
        outer = [range(n) for n in shape[:cut]]
        self._spans = [
            (sum(i * s for i, s in zip(idx, strides[:cut])) * item, run * item)
            for idx in itertools.product(*outer)
        ]
        self._shape, self._strides = shape, strides

    def pieces(self, index: int) -> list[memoryview]:
        """The page at host slot `index` as byte views of the pool's memory (zero-copy pools)."""
        assert self._whole is not None
        view = self.pool.get_data_page(index, flat=False)
        if tuple(view.shape) != self._shape or tuple(view.stride()) != self._strides:
            self._learn(view)
        base = view.data_ptr() - self._storage_ptr
        whole = self._whole
        return [whole[base + off : base + off + n] for off, n in self._spans]

    def copy_out(self, index: int) -> torch.Tensor:
        """The page at `index` as a contiguous tensor of its own (the copy path's write)."""
        page: torch.Tensor = self.pool.get_data_page(index, flat=True)
        return page.contiguous()

    def scratch(self) -> torch.Tensor:
        """A page-sized buffer to read into (the copy path's read)."""
        page: torch.Tensor = self.pool.get_dummy_flat_data_page()
        return page

    def copy_in(self, index: int, page: torch.Tensor) -> None:
        self.pool.set_from_flat_data_page(index, page)


def storage_hash(key: str) -> str:
    """SGLang's page hash as a hicache page hash: its 64 hex SHA-256 chain value as is (each
    names its whole prefix, and the request's cache_salt seeds the chain), anything else
    hashed to one."""
    if len(key) == 64:
        try:
            bytes.fromhex(key)
            return key.lower()
        except ValueError:
            pass
    return hashlib.sha256(key.encode()).hexdigest()


def pool_namespace(
    pool: Any,
    pool_name: str,
    *,
    config: Any,
    model: str,
    salt: str,
    seal: Any,
    page_bytes: int,
) -> Namespace:
    """The namespace of one host pool's values: model, geometry, dtype, page size, layout,
    TP rank and size (not for MLA KV, which every rank holds alike), pipeline stage and
    context-parallel rank, and the tenant salt; any difference gives disjoint keys."""
    layout = str(getattr(pool, "layout", ""))
    dtype = _dtype_name(getattr(pool, "dtype", torch.uint8))
    layers = int(getattr(pool, "layer_num", 0) or 0)
    kv_dtype = dtype if dtype in KV_DTYPES else "uint8"
    is_kv = pool_name == "kv"
    if is_kv and getattr(pool, "kv_lora_rank", None) is not None:
        kv = f"mla:{layers}:{int(pool.kv_lora_rank)}:{int(pool.qk_rope_head_dim)}:{kv_dtype}"
    elif is_kv and getattr(pool, "head_num", None) is not None:
        kv = f"mha:{layers}:{int(pool.head_num)}:{int(pool.head_dim)}:{kv_dtype}"
    else:  # a state or sidecar pool: its bytes, sharded per TP rank like MHA heads
        kv = "mha:0:1:1:uint8"
    parts = [
        "sglang",
        pool_name,
        type(pool).__name__,
        layout,
        dtype,
        f"bytes={page_bytes}",
        f"v={getattr(pool, 'v_head_dim', '')}",
        f"dim={getattr(pool, 'kv_cache_dim', '')}",
        f"layers={getattr(pool, 'start_layer', '')}-{getattr(pool, 'end_layer', '')}",
        f"pp={config.pp_rank}/{config.pp_size}",
        f"cp={config.attn_cp_rank}/{config.attn_cp_size}",
        f"dcp={getattr(config, 'dcp_rank', 0)}/{getattr(config, 'dcp_size', 1)}",
    ]
    return Namespace(
        model=model,
        kv=kv,
        page_size=int(getattr(pool, "page_size", 1) or 1),
        tenant=salt,
        rank=int(config.tp_rank),
        tp_size=int(config.tp_size),
        layout="|".join(parts),
        seal=seal,
    )
