"""Naive per-token reference for the transfer tests, written from the documented layout shapes
independently of hicache.kernels.layouts."""

from __future__ import annotations

import numpy as np
import torch


def row_offset(layout, g, size, ps, slot, layer, comp, head, room=0) -> int:
    """Byte offset of one head row; `room` bytes of header room precede every page of the
    page-contiguous layouts."""
    L, C, H = g.layers, g.components, g.row_heads
    row = g.row_dim * g.itemsize
    p, o = divmod(slot, ps)
    if layout == "layer_first":
        index = ((layer * C + comp) * size + slot) * H + head
    elif layout == "page_first":
        index = ((slot * L + layer) * C + comp) * H + head
    elif layout == "page_first_direct":
        index = (((p * L + layer) * C + comp) * ps + o) * H + head
    elif layout == "page_head":
        index = (((p * C + comp) * H + head) * ps + o) * L + layer
    else:
        raise AssertionError(layout)
    return index * row + (0 if layout == "layer_first" else (p + 1) * room)


def device_bytes(pool, layer, comp) -> np.ndarray:
    return (
        pool.buffer(layer, comp)
        .view(torch.uint8)
        .numpy()
        .reshape(pool.size, pool.geometry.row_heads, -1)
    )


def naive_load(host, device, host_slots, device_slots, layer) -> None:
    g = host.geometry
    raw = host.buffer.numpy()
    row = g.row_dim * g.itemsize
    for hs, ds in zip(host_slots.tolist(), device_slots.tolist()):
        for comp in range(g.components):
            dst = device_bytes(device, layer, comp)
            for head in range(g.row_heads):
                off = row_offset(
                    host.layout,
                    g,
                    host.size,
                    host.page_size,
                    hs,
                    layer,
                    comp,
                    head,
                    host.header_room,
                )
                dst[ds, head] = raw[off : off + row]


def naive_backup(device, host, device_slots, host_slots) -> None:
    g = host.geometry
    raw = host.buffer.numpy()
    row = g.row_dim * g.itemsize
    for hs, ds in zip(host_slots.tolist(), device_slots.tolist()):
        for layer in range(g.layers):
            for comp in range(g.components):
                src = device_bytes(device, layer, comp)
                for head in range(g.row_heads):
                    off = row_offset(
                        host.layout,
                        g,
                        host.size,
                        host.page_size,
                        hs,
                        layer,
                        comp,
                        head,
                        host.header_room,
                    )
                    raw[off : off + row] = src[ds, head]


def randomize(pool_or_tensor, rng: np.random.Generator) -> None:
    """Fill with random bytes (any dtype, float8 included)."""
    if isinstance(pool_or_tensor, torch.Tensor):
        view = pool_or_tensor.view(torch.uint8).numpy()
        view[...] = rng.integers(0, 256, size=view.shape, dtype=np.uint8)
        return
    for layer in range(pool_or_tensor.geometry.layers):
        for comp in range(pool_or_tensor.geometry.components):
            randomize(pool_or_tensor.buffer(layer, comp), rng)


def random_page_slots(rng, pool_size: int, ps: int, pages: int) -> np.ndarray:
    """`pages` distinct random pages of a pool, in random order, as slot indices."""
    chosen = rng.choice(pool_size // ps, size=pages, replace=False)
    return (chosen[:, None] * ps + np.arange(ps)).ravel().astype(np.int64)
