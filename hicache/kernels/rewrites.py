"""Configuration rewrites for host layout and io backend, after the seed design.

A pure function: the resolved settings plus each rewrite as data (the caller logs them as
warning events). Where no rewrite is sound it raises ValueError. The transfer functions accept
every combination; these rules steer a deployment to the combinations the seed runs on GPU.

Rules, applied in this order:
1. unknown layout or io backend: error.
2. `page_head` with MLA: error (page_head splits a page by head; MLA has a single latent row).
3. zero-copy storage (L3 wants a page as one piece) with `layer_first`: layout becomes
   `page_first_direct` under `direct` io, else `page_first`.
4. `page_first_direct` with `kernel` io: io becomes `direct` (the seed has no kernel for it).
5. `direct` io with `page_first`: layout becomes `page_first_direct` (a page_first page is
   strided per layer, so a direct copy per range would degrade to one copy per token).
6. `direct` io with `page_head`: layout becomes `page_first_direct` (same reason; the seed has
   no direct page_head path).
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.kernels.layouts import LAYOUTS
from hicache.kernels.transfer import IO_BACKENDS


@dataclass(frozen=True, slots=True)
class TransferSettings:
    layout: str
    io: str


@dataclass(frozen=True, slots=True)
class SettingRewrite:
    """One changed setting, to be logged as a warning event."""

    setting: str  # "layout" or "io"
    old: str
    new: str
    reason: str


def resolve_transfer_settings(*, layout: str, io: str, attention: str,
                              zero_copy_storage: bool = False) -> tuple[TransferSettings, tuple[SettingRewrite, ...]]:
    """Apply the rules above to (layout, io) for `attention` ("mha" or "mla")."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown host layout {layout!r}; expected one of {list(LAYOUTS)}")
    if io not in IO_BACKENDS:
        raise ValueError(f"unknown io backend {io!r}; expected one of {list(IO_BACKENDS)}")
    if attention not in ("mha", "mla"):
        raise ValueError(f"attention must be 'mha' or 'mla', got {attention!r}")
    if layout == "page_head" and attention == "mla":
        raise ValueError("host layout 'page_head' is MHA only; choose page_first or page_first_direct for MLA")
    rewrites: list[SettingRewrite] = []

    def change(setting: str, new: str, reason: str) -> None:
        nonlocal layout, io
        old = layout if setting == "layout" else io
        rewrites.append(SettingRewrite(setting, old, new, reason))
        if setting == "layout":
            layout = new
        else:
            io = new

    if zero_copy_storage and layout == "layer_first":
        change("layout", "page_first_direct" if io == "direct" else "page_first",
               "zero-copy storage needs each page contiguous in host memory")
    if layout == "page_first_direct" and io == "kernel":
        change("io", "direct", "page_first_direct is served by the direct io backend")
    if io == "direct" and layout in ("page_first", "page_head"):
        change("layout", "page_first_direct", f"direct io copies contiguous ranges; {layout} pages are strided per layer")
    return TransferSettings(layout, io), tuple(rewrites)
