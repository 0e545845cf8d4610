"""Device (L1) and host (L2) KV pools.

Ownership: a pool owns its buffers' *layout*; which slots hold what is decided elsewhere (the
allocator's ledgers and the tree). Pools never allocate or free slots. The engine's attention
reads and writes the device buffers; the transfer functions read and write both pools, only at
the slots a command names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hicache.kernels.geometry import Geometry
from hicache.kernels.indices import SlotArray, as_slot_array, check_pages
from hicache.kernels.layouts import (
    PAGE_CONTIGUOUS_LAYOUTS,
    check_layout,
    host_shape,
    page_pieces,
    page_view,
    word_dtype,
)
from hicache.kernels.layouts import header_room as header_room_of
from hicache.kernels.pinning import LazyHostMemory, cpu_bytes


class PagePieces(list[memoryview]):
    """One host page as `HostPool.page_buffers` hands it to storage: its pieces (C-contiguous
    byte memoryviews, in value order) and `header_room`, how many bytes right before the first
    piece hold no KV and are free for the backend working on this page to write (a value
    header, so header and page move as one piece). 0 means none; a backend must not touch
    memory outside the pieces then. `checked` says the pieces are already what a backend
    checks for (writable, C-contiguous, one-dimensional byte views): the pool sets it on the
    pages it hands out, so a batch of them is not checked piece by piece again."""

    __slots__ = ("checked", "header_room")

    def __init__(
        self, pieces: Iterable[memoryview] = (), header_room: int = 0, *, checked: bool = False
    ) -> None:
        super().__init__(pieces)
        self.header_room = header_room
        self.checked = checked


def _pool_page(piece: memoryview, header_room: int) -> PagePieces:
    """`PagePieces((piece,), header_room, checked=True)` without the Python-level __init__
    (a host pool makes one per page moved to or from storage)."""
    page = _new_pieces(PagePieces)
    page.append(piece)
    page.header_room = header_room
    page.checked = True
    return page


_new_pieces = PagePieces.__new__


def _check_page_size(page_size: int) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")


def cuda_usable() -> bool:
    """Whether torch can use a CUDA device here (the CPU build of torch says no)."""
    return bool(torch.cuda.is_available())


class DevicePool:
    """L1 KV buffers for one rank: MHA per layer K and V `(size, heads, head_dim)`; MLA per layer
    one latent `(size, 1, rank + rope)`. Slot `i` is token row `i` of every buffer.

    Invariants: every buffer is contiguous, has the geometry's dtype and shape, and all live on
    one device; `size` is a multiple of `page_size`. Immutable after construction (the tensors'
    contents change, the pool object does not)."""

    def __init__(
        self,
        geometry: Geometry,
        page_size: int,
        buffers: Sequence[Sequence[torch.Tensor]],
        *,
        empty: tuple[int, torch.device] | None = None,
    ):
        """`buffers[layer][component]`; prefer `allocate` or `wrap`. Validates everything.
        `empty`: (size, device) of a pool of 0 layers, which has no buffer to read them from
        (its slots are ledger entries only: pages with no K/V)."""
        _check_page_size(page_size)
        if len(buffers) != geometry.layers:
            raise ValueError(f"expected {geometry.layers} layers of buffers, got {len(buffers)}")
        size = None
        device = None
        shape_tail = (geometry.row_heads, geometry.row_dim)
        for layer, row in enumerate(buffers):
            if len(row) != geometry.components:
                raise ValueError(
                    f"layer {layer}: expected {geometry.components} buffers, got {len(row)}"
                )
            for component, buf in enumerate(row):
                where = f"layer {layer} {self._component_name(geometry, component)} buffer"
                if not isinstance(buf, torch.Tensor):
                    raise TypeError(f"{where} must be a torch.Tensor, got {type(buf).__name__}")
                if buf.dtype != geometry.dtype:
                    raise ValueError(
                        f"{where} has dtype {buf.dtype}, geometry says {geometry.dtype}"
                    )
                if buf.dim() != 3 or tuple(buf.shape[1:]) != shape_tail:
                    raise ValueError(
                        f"{where} has shape {tuple(buf.shape)}, expected (tokens, *{shape_tail})"
                    )
                if not buf.is_contiguous():
                    raise ValueError(f"{where} must be contiguous")
                size = buf.shape[0] if size is None else size
                device = buf.device if device is None else device
                if buf.shape[0] != size:
                    raise ValueError(
                        f"{where} has {buf.shape[0]} tokens, other buffers have {size}"
                    )
                if buf.device != device:
                    raise ValueError(f"{where} is on {buf.device}, other buffers are on {device}")
        if not buffers:
            if empty is None:
                raise ValueError("a pool of 0 layers needs its size and device (empty=)")
            size, device = empty[0], torch.device(empty[1])
        assert size is not None and device is not None
        if size == 0 or size % page_size:
            raise ValueError(
                f"device pool size {size} must be a positive multiple of page_size {page_size}"
            )
        self.geometry = geometry
        self.page_size = page_size
        self.size: int = size
        self.device: torch.device = device
        self._buffers = tuple(tuple(row) for row in buffers)
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}
        row_bytes = geometry.row_dim * geometry.itemsize
        align = math.gcd(
            row_bytes, *(b.data_ptr() % 64 or 64 for row in self._buffers for b in row)
        )
        self.word: torch.dtype = word_dtype(align)

    @staticmethod
    def _component_name(geometry: Geometry, component: int) -> str:
        return ("K", "V")[component] if geometry.kind == "mha" else "latent"

    @classmethod
    def allocate(
        cls, geometry: Geometry, size: int, page_size: int, device: str | torch.device = "cpu"
    ) -> DevicePool:
        """New zeroed buffers of `size` tokens on `device`."""
        _check_page_size(page_size)
        if size <= 0 or size % page_size:
            raise ValueError(
                f"device pool size {size} must be a positive multiple of page_size {page_size}"
            )
        shape = (size, geometry.row_heads, geometry.row_dim)

        def zeros() -> torch.Tensor:
            if torch.device(device).type != "cpu":
                return torch.zeros(shape, dtype=geometry.dtype, device=device)
            return cpu_bytes(math.prod(shape) * geometry.itemsize).view(geometry.dtype).view(shape)

        buffers = [[zeros() for _ in range(geometry.components)] for _ in range(geometry.layers)]
        return cls(geometry, page_size, buffers, empty=(size, torch.device(device)))

    @classmethod
    def wrap(
        cls,
        geometry: Geometry,
        page_size: int,
        *,
        k_buffers: Sequence[torch.Tensor] | None = None,
        v_buffers: Sequence[torch.Tensor] | None = None,
        latent_buffers: Sequence[torch.Tensor] | None = None,
    ) -> DevicePool:
        """Wrap an engine's own per-layer tensors (MHA: `k_buffers` and `v_buffers`; MLA:
        `latent_buffers`); nothing is copied. Raises if shapes, dtypes or devices disagree."""
        if geometry.kind == "mha":
            if k_buffers is None or v_buffers is None or latent_buffers is not None:
                raise ValueError(
                    "an MHA pool wraps k_buffers and v_buffers (and no latent_buffers)"
                )
            if len(k_buffers) != len(v_buffers):
                raise ValueError(f"{len(k_buffers)} K buffers but {len(v_buffers)} V buffers")
            return cls(geometry, page_size, list(zip(k_buffers, v_buffers)))
        if latent_buffers is None or k_buffers is not None or v_buffers is not None:
            raise ValueError("an MLA pool wraps latent_buffers (and no k_buffers/v_buffers)")
        return cls(geometry, page_size, [[b] for b in latent_buffers])

    def buffer(self, layer: int, component: int) -> torch.Tensor:
        """The (size, row_heads, row_dim) tensor of one layer's component (0=K/latent, 1=V)."""
        return self._buffers[layer][component]

    def k_buffer(self, layer: int) -> torch.Tensor:
        self._need("mha")
        return self._buffers[layer][0]

    def v_buffer(self, layer: int) -> torch.Tensor:
        self._need("mha")
        return self._buffers[layer][1]

    def latent_buffer(self, layer: int) -> torch.Tensor:
        self._need("mla")
        return self._buffers[layer][0]

    def _need(self, kind: str) -> None:
        if self.geometry.kind != kind:
            raise TypeError(
                f"this is an {self.geometry.kind.upper()} pool; that accessor is for {kind.upper()}"
            )

    def page_view(self, layer: int, component: int, word: torch.dtype) -> torch.Tensor:
        """(pages, page_size, heads, words) view of one buffer, for transfers (kept: a layer
        load asks for the same views each time)."""
        key = (layer, component, word)
        view = self._views.get(key)
        if view is None:
            buf = self._buffers[layer][component]
            view = self._views[key] = (
                buf.view(torch.uint8)
                .view(word)
                .view(self.size // self.page_size, self.page_size, self.geometry.row_heads, -1)
            )
        return view

    def __repr__(self) -> str:
        return f"DevicePool({self.geometry.spec()}, size={self.size}, page_size={self.page_size}, device={self.device})"


class HostPool:
    """L2 KV storage in one flat byte buffer laid out as `layout` (see layouts.py), pinned when
    CUDA is usable. Size exceeds the device pool's and is page-aligned (checked).

    `buffer` is the uint8 tensor; `page_buffers` hands out zero-copy memoryviews of it. In a
    page-contiguous layout each page may be preceded by `header_room` bytes that hold no KV,
    for storage backends to put a value header next to the page (layouts.py, "Header room");
    None picks it (512 bytes where that is at most 1/64 of a page), 0 turns it off.

    With `prepare` (the default) every slot's memory is faulted in (and pinned) now. Without
    it the memory is only mapped, and a slot may be used only once `prepare_slots` has made
    its pages ready: the allocator actor does that chunk by chunk and leases each chunk to the
    tree when it is. `runtime`: a stand-in for cuda-python's runtime (tests)."""

    def __init__(
        self,
        device_pool: DevicePool,
        size: int,
        layout: str,
        *,
        pin_memory: bool | None = None,
        header_room: int | None = None,
        prepare: bool = True,
        runtime: Any = None,
    ):
        geometry, page_size = device_pool.geometry, device_pool.page_size
        check_layout(layout, geometry)
        if isinstance(size, bool) or not isinstance(size, int) or size <= device_pool.size:
            raise ValueError(
                f"host pool size {size!r} must be an int larger than the device pool ({device_pool.size})"
            )
        if size % page_size:
            raise ValueError(f"host pool size {size} must be a multiple of page_size {page_size}")
        pin = cuda_usable() if pin_memory is None else pin_memory
        self.geometry = geometry
        self.page_size = page_size
        self.size = size
        self.layout = layout
        self.pinned = pin
        self.header_room = header_room_of(layout, geometry, page_size, header_room)
        self.nbytes = size * geometry.bytes_per_token + (size // page_size) * self.header_room
        self.memory = LazyHostMemory(self.nbytes, pin=pin, runtime=runtime)
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}
        self.word: torch.dtype = word_dtype(geometry.row_dim * geometry.itemsize)
        self._adopt_buffer()
        if prepare:
            why = self.prepare_slots(0, size)
            if why is not None:
                self.fall_back(why)

    def _adopt_buffer(self) -> None:
        self.buffer: torch.Tensor = self.memory.buffer
        self._bytes = self.buffer.numpy()  # shares memory with `buffer`
        self._whole = self._bytes.data  # a byte memoryview, sliced per page by `page_buffers`
        self._views.clear()

    @property
    def pinning(self) -> str:
        """How the memory was made: "registered" (cudaHostRegister, range by range),
        "torch[: why not registered]" (torch's pinned allocator) or "none"."""
        return self.memory.pinning

    @property
    def lazy(self) -> bool:
        """Whether slots need `prepare_slots` before use (False: all usable now)."""
        return self.memory.lazy

    def slot_bytes(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Byte ranges `[lo, hi)` of the buffer that hold slots `[start, stop)` (whole pages)
        and, in a page-contiguous layout, their pages' header room: one range there, one per
        (layer, component) in `layer_first`. Pure."""
        ps = self.page_size
        if not (0 <= start < stop <= self.size) or start % ps or stop % ps:
            raise ValueError(
                f"slots [{start}, {stop}) are not whole pages inside the host pool [0, {self.size})"
            )
        args = (self.layout, self.geometry, self.size, ps)
        first = page_pieces(*args, start // ps, self.header_room)
        last = page_pieces(*args, stop // ps - 1, self.header_room)
        room = self.header_room  # in front of each page's first piece
        return [(lo - room, hi + n) for (lo, _), (hi, n) in zip(first, last, strict=True)]

    def prepare_slots(self, start: int, stop: int) -> str | None:
        """Fault in (and, pinned, register) the memory of slots `[start, stop)`, skipping what
        is ready already. None when they are usable; else why registering failed (the slots
        are then not to be used while the pool is pinned: a copy engine may read them through
        the device mapping). Mutates; may take long (run it off the event loop)."""
        if not self.memory.lazy:
            return None
        return self.memory.prepare(self.slot_bytes(start, stop))

    def fall_back(self, why: str) -> None:
        """Registering failed from the first slots on: take the whole buffer from torch's
        pinned allocator, every slot usable at once (`pinning` says why). Only before
        anything has used the buffer."""
        self.memory.fall_back(why)
        self._adopt_buffer()

    def unpin(self) -> int:
        """Undo every registration of the buffer (the memory stays usable, unpinned); how
        many ranges were registered. Idempotent. Only once no copy uses the pool."""
        return self.memory.unpin()

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page over all layers (the L3 value length)."""
        return self.page_size * self.geometry.bytes_per_token

    @property
    def pages(self) -> int:
        return self.size // self.page_size

    def shaped(self) -> torch.Tensor:
        """The KV viewed in the layout's shape and the KV dtype (layouts.py table). With header
        room the page dim steps over it, and `page_first`'s slot dim S comes split as (P, ps)."""
        shape = host_shape(self.layout, self.geometry, self.size, self.page_size)
        kv = self.buffer.view(self.geometry.dtype)
        if not self.header_room:
            return kv.view(shape)
        item = self.geometry.itemsize
        pages = kv.view(self.pages, -1)[:, self.header_room // item :]
        if self.layout == "page_first":  # slots cannot be one dim across the rooms
            return pages.view(self.pages, self.page_size, *shape[1:])
        return pages.view(shape)

    def page_view(
        self, layer: int, component: int, word: torch.dtype, buffer: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(pages, page_size, heads, words) view of one (layer, component); `buffer` replaces the
        host buffer with an alias of it (a CUDA mapping of the pinned memory). Views are kept:
        a layer load asks for the same ones each time."""
        base = self.buffer if buffer is None else buffer
        key = (layer, component, word, base.device, base.data_ptr())
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = page_view(
                base.view(word),
                self.layout,
                self.geometry,
                self.size,
                self.page_size,
                layer,
                component,
                self.header_room,
            )
        return view

    def page_buffers(self, host_slots: SlotArray) -> list[PagePieces]:
        """For each page of `host_slots` (whole pages, in order): its pieces as C-contiguous byte
        memoryviews aliasing this pool (writing them writes the pool), with the page's header
        room (`PagePieces`). Does not mutate."""
        slots = as_slot_array(host_slots, "host_slots")
        pages = check_pages(slots, self.page_size, self.size, "host_slots")
        room = self.header_room
        if self.layout in PAGE_CONTIGUOUS_LAYOUTS:  # one piece a page: offsets in one pass
            nbytes = self.page_size * self.geometry.bytes_per_token
            whole = self._whole
            starts = (room + pages * (nbytes + room)).tolist()
            return [_pool_page(whole[o : o + nbytes], room) for o in starts]
        out = []
        for page in pages.tolist():
            pieces = page_pieces(
                self.layout, self.geometry, self.size, self.page_size, page, self.header_room
            )
            out.append(
                PagePieces(
                    [self._bytes[o : o + n].data for o, n in pieces],
                    self.header_room,
                    checked=True,
                )
            )
        return out

    def __repr__(self) -> str:
        return (
            f"HostPool({self.geometry.spec()}, size={self.size}, page_size={self.page_size}, "
            f"layout={self.layout}, pinned={self.pinned}, header_room={self.header_room})"
        )
