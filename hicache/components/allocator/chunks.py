"""How the allocator cuts the host pool into the chunks it prepares and leases."""

from __future__ import annotations


def chunk_plan(size: int, page_size: int, chunk_pages: int) -> list[tuple[int, int]]:
    """The slot ranges ``[start, stop)`` the allocator prepares and leases the host pool in, in
    order: `chunk_pages` whole pages each (the last one what is left), covering ``[0, size)``.
    Pure."""
    if page_size < 1 or chunk_pages < 1 or size < 0 or size % page_size:
        raise ValueError(
            f"chunk_plan needs size a multiple of page_size >= 1 and chunk_pages >= 1, got "
            f"size={size}, page_size={page_size}, chunk_pages={chunk_pages}"
        )
    step = chunk_pages * page_size
    return [(start, min(size, start + step)) for start in range(0, size, step)]
