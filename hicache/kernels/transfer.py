"""Transfer functions: load one layer host->device, back up all layers device->host.

Both io backends work with every layout (tests cover the full matrix); the one configuration
rewrite (`CacheConfig.resolve`: `direct` io turns `page_first` into `page_first_direct`) only
avoids a slow combination.

- `kernel`: gather/scatter whole pages through index tensors, all (layer, component) views of
  the transfer handed to the engine at once (the CPU engine batches them into one row copy).
- `direct`: coalesce runs of pages consecutive on both sides; one copy per run (an engine may
  batch many short runs as one gather/scatter: `max_run_copies`, counted over all views).

The validating entry points (`load_layer`, `backup`) check everything before any byte moves;
the `run_*` forms take an already validated `PagePlan` (streams validate at submit time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hicache.kernels.engines import CopyEngine, engine_for
from hicache.kernels.indices import PagePlan, SlotArray, plan_transfer
from hicache.kernels.names import IO_BACKENDS
from hicache.kernels.pools import DevicePool, HostPool
from hicache.kernels.rows import UnreachableMemory


def check_io(io: str) -> None:
    if io not in IO_BACKENDS:
        raise ValueError(f"unknown io backend {io!r}; expected one of {list(IO_BACKENDS)}")


def _word(host: HostPool, device: DevicePool) -> torch.dtype:
    return host.word if host.word.itemsize <= device.word.itemsize else device.word


def merge_trailing(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two page views (same shape but for the page count) with trailing dims merged where both
    are contiguous across them: fewer, longer rows make index ops and copies far cheaper."""
    shape, sa, sb = list(a.shape), list(a.stride()), list(b.stride())
    i = len(shape) - 2
    while i >= 1:
        if sa[i] == shape[i + 1] * sa[i + 1] and sb[i] == shape[i + 1] * sb[i + 1]:
            shape[i : i + 2] = [shape[i] * shape[i + 1]]
            sa[i : i + 2] = [sa[i + 1]]
            sb[i : i + 2] = [sb[i + 1]]
        i -= 1
    return a.as_strided([a.shape[0], *shape[1:]], sa), b.as_strided([b.shape[0], *shape[1:]], sb)


Pairs = list[tuple[torch.Tensor, torch.Tensor]]

ENGINE_DEVICE = {"cpu": "cpu", "cuda": "cuda"}
"""The device type whose pools each engine kind moves (the host side is always host memory)."""


def check_reach(engine: CopyEngine, device: DevicePool) -> None:
    """Raise `UnreachableMemory` when `engine` cannot address `device`'s memory: a CPU engine
    handed a GPU pool would dereference device pointers on the host (a segmentation fault)."""
    own = getattr(engine, "device", None)  # a device engine is bound to one device
    # An engine bound to a device reaches that device's type (a CUDA engine built over host
    # pools with a stand-in issuer, in unit tests, moves host memory); others their kind's.
    reaches = own.type if isinstance(own, torch.device) else ENGINE_DEVICE.get(engine.kind)
    if reaches is not None and device.device.type != reaches:
        raise UnreachableMemory(
            f"the {engine.kind.upper()} copy engine cannot move a device pool on "
            f"{device.device}; pools on {device.device.type} move with "
            f"engine_for({device.device.type!r})"
        )
    if (
        isinstance(own, torch.device)
        and own.index is not None
        and device.device.index is not None
        and own != device.device
    ):
        raise UnreachableMemory(
            f"a copy engine bound to {own} cannot move a device pool on {device.device}"
        )


def _pairs(
    engine: CopyEngine,
    device: DevicePool,
    host: HostPool,
    words: torch.Tensor,
    to_device: bool,
    layer: int | None,
    make: Callable[[], Pairs],
) -> Pairs:
    """The merged page-view pairs `make()` lists, kept in the engine per (pools, host words,
    direction, layer): the same few sets serve every transfer, and merging them (`as_strided`
    per view) cost as much as a small backup's copy. A hit is checked by identity against the
    objects the entry keeps (so an id reused by a new pool is never mistaken for the old)."""
    cache: dict[Any, Any] | None = getattr(engine, "pair_cache", None)
    if cache is None:  # an engine that keeps none
        check_reach(engine, device)
        return [merge_trailing(dst, src) for dst, src in make()]
    owners = (device, host, words)
    key = (id(device), id(host), id(words), to_device, -1 if layer is None else layer)
    hit = cache.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], owners)):
        pairs: Pairs = hit[1]
        return pairs
    check_reach(engine, device)  # once per cached set of views, not per transfer
    pairs = [merge_trailing(dst, src) for dst, src in make()]
    if len(cache) >= 64:
        cache.clear()
    cache[key] = (owners, pairs)
    return pairs


def _move(
    engine: CopyEngine,
    io: str,
    plan: PagePlan,
    pairs: Pairs,
    to_device: bool,
) -> None:
    """Copy the planned pages for every (dst, src) pair of page views (one per layer and
    component; trailing dims already merged, `_pairs`); the engine may batch all pairs into
    one operation."""
    if io == "direct":  # CUDA: the whole transfer as one copy list, one driver call
        copy_direct = getattr(engine, "copy_direct", None)
        if copy_direct is not None and copy_direct(pairs, plan, to_device=to_device):
            return
    runs = plan.runs() if io == "direct" else None
    if runs is None or len(runs) * len(pairs) > engine.max_run_copies:
        # The CPU engine takes the plan's numpy pages as they are (no torch round trip).
        move_numpy = getattr(engine, "move_numpy", None)
        if move_numpy is not None and move_numpy(
            pairs,
            plan.device_pages if to_device else plan.host_pages,
            plan.host_pages if to_device else plan.device_pages,
        ):
            return
        dst0 = pairs[0][0]
        host_idx, dev_idx = plan.index_tensors(
            dst0.device if dst0.device.type != "cpu" else pairs[0][1].device
        )
        if to_device:
            engine.move(pairs, dev_idx, host_idx, host_is_dst=False)
        else:
            engine.move(pairs, host_idx, dev_idx, host_is_dst=True)
        return
    for dst, src in pairs:
        for host_page, dev_page, count in runs:
            if to_device:
                engine.copy_run(
                    dst[dev_page : dev_page + count], src[host_page : host_page + count]
                )
            else:
                engine.copy_run(
                    dst[host_page : host_page + count], src[dev_page : dev_page + count]
                )


def run_load_layer(
    plan: PagePlan, host: HostPool, device: DevicePool, layer: int, io: str, engine: CopyEngine
) -> int:
    """Copy `layer` of the planned pages host->device; returns bytes moved. No validation."""
    word = _word(host, device)
    words = engine.host_words(host)
    pairs = _pairs(
        engine,
        device,
        host,
        words,
        True,
        layer,
        lambda: [
            (device.page_view(layer, c, word), host.page_view(layer, c, word, words))
            for c in range(device.geometry.components)
        ],
    )
    _move(engine, io, plan, pairs, to_device=True)
    return plan.tokens * device.geometry.bytes_per_token // device.geometry.layers


def run_load_all(
    plan: PagePlan, host: HostPool, device: DevicePool, io: str, engine: CopyEngine
) -> int:
    """Copy every layer of the planned pages host->device as one move; returns bytes moved. No
    validation. For loads whose layers all land before anyone waits (inline CPU copies): one
    pass over whole host pages instead of a strided pass per layer (page_first: 2 KiB of every
    64 KiB per layer)."""
    word = _word(host, device)
    words = engine.host_words(host)
    pairs = _pairs(
        engine,
        device,
        host,
        words,
        True,
        None,
        lambda: [
            (device.page_view(layer, c, word), host.page_view(layer, c, word, words))
            for layer in range(device.geometry.layers)
            for c in range(device.geometry.components)
        ],
    )
    _move(engine, io, plan, pairs, to_device=True)
    return plan.tokens * device.geometry.bytes_per_token


def run_backup(
    plan: PagePlan, device: DevicePool, host: HostPool, io: str, engine: CopyEngine
) -> int:
    """Copy all layers of the planned pages device->host; returns bytes moved. No validation."""
    word = _word(host, device)
    words = engine.host_words(host)
    pairs = _pairs(
        engine,
        device,
        host,
        words,
        False,
        None,
        lambda: [
            (host.page_view(layer, c, word, words), device.page_view(layer, c, word))
            for layer in range(device.geometry.layers)
            for c in range(device.geometry.components)
        ],
    )
    _move(engine, io, plan, pairs, to_device=False)
    return plan.tokens * device.geometry.bytes_per_token


def _check_layer(device: DevicePool, layer: int) -> None:
    if (
        isinstance(layer, bool)
        or not isinstance(layer, int)
        or not 0 <= layer < device.geometry.layers
    ):
        raise ValueError(f"layer {layer!r} out of range [0, {device.geometry.layers})")


def load_layer(
    host: HostPool,
    device: DevicePool,
    host_slots: SlotArray,
    device_slots: SlotArray,
    layer: int,
    *,
    io: str = "kernel",
    engine: CopyEngine | None = None,
) -> int:
    """Copy one layer of `host_slots` into `device_slots` (synchronously on CPU; enqueued on the
    current stream on CUDA). Validates first; returns bytes moved."""
    check_io(io)
    _check_layer(device, layer)
    plan = plan_transfer(host, device, host_slots, device_slots)
    return run_load_layer(plan, host, device, layer, io, engine or engine_for(device.device))


def backup(
    device: DevicePool,
    host: HostPool,
    device_slots: SlotArray,
    host_slots: SlotArray,
    *,
    io: str = "kernel",
    engine: CopyEngine | None = None,
) -> int:
    """Copy all layers of `device_slots` into `host_slots`. Validates first; returns bytes moved."""
    check_io(io)
    plan = plan_transfer(host, device, host_slots, device_slots)
    return run_backup(plan, device, host, io, engine or engine_for(device.device))
