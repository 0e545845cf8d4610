"""vLLM's KV cache groups mapped onto hicache's hybrid rule (pure: no vLLM, no I/O).

vLLM's hybrid KV cache manager gives each group its own block table (`SupportsHMA`); a
stored page is every group's block of it, in group order (layout.GroupGeometry). The rule of
how far a hit may go is hicache's (`hicache.hybrid.HybridModel.usable`): the groups map onto
`FullAttention` and paged `SlidingWindow` groups, one hicache layer per vLLM layer, so a hit is
every whole page L2 and L3 hold, short of the last token. Which blocks a hit restores, per
group, follows from the same declaration: full attention every page of it, a sliding window
only the pages that hold its window before the hit point, [h - W + 1, h). vLLM nulls a sliding
group's older blocks itself (layout.NULL_BLOCK); a block vLLM gave is filled, a null block is
left alone, and a null block where the window needs K/V makes the whole load fail (vLLM
recomputes) instead of running on a hole.
"""

from __future__ import annotations

from hicache.hybrid import FullAttention, HybridModel, SlidingWindow
from hicache.hybrid.groups import LayerGroup
from hicache.integrations.vllm.layout import NULL_BLOCK, Geometry, GroupGeometry

Row = tuple[int, ...]
"""One page's vLLM blocks, one per group in vLLM's group order."""


def hybrid_model(geometry: Geometry) -> HybridModel:
    """hicache's declaration of vLLM's groups: hicache layer i is `geometry.layers[i]`."""
    groups: list[LayerGroup] = []
    first = 0
    for part in geometry.parts:
        layers = tuple(range(first, first + len(part.layers)))
        first += len(part.layers)
        if part.kind == "sliding":
            groups.append(SlidingWindow(layers, part.window))
        else:
            groups.append(FullAttention(layers))
    return HybridModel(tuple(groups), geometry.block_size)


def needs(part: GroupGeometry, page: int, hit: int, block_size: int) -> bool:
    """Whether a hit of `hit` tokens needs page `page` of this group: full attention every
    page below the hit, a sliding window the pages holding tokens [hit - W + 1, hit)."""
    if page * block_size >= hit:
        return False
    if part.kind == "sliding":
        return (page + 1) * block_size > hit - part.window + 1
    return True


def hole(geometry: Geometry, rows: list[Row], first_page: int, hit: int) -> tuple[int, int] | None:
    """(page, group) of the first null block a hit of `hit` tokens needs, among `rows`
    (pages first_page, first_page + 1, ...); None when every needed block is there."""
    for k, row in enumerate(rows):
        page = first_page + k
        for g, part in enumerate(geometry.parts):
            if (
                row[g] == NULL_BLOCK
                and part.nullable
                and needs(part, page, hit, geometry.block_size)
            ):
                return page, g
    return None


def storable(geometry: Geometry, row: Row) -> bool:
    """A page is stored whole: every group's block is the request's own (none nulled)."""
    return not any(b == NULL_BLOCK and p.nullable for b, p in zip(row, geometry.parts))


def check_policies(write_policy: str, geometry: Geometry) -> None:
    """Refuse, naming why, a write policy these groups cannot be stored under: write_back
    stores a request's pages when vLLM frees it, and vLLM drops a sliding window group's
    blocks older than the window before then."""
    if write_policy == "write_back" and any(p.nullable for p in geometry.parts):
        raise ValueError(
            "HiCacheConnector: write_back needs every page's blocks when vLLM frees the "
            "request, and vLLM drops a sliding window group's older blocks before then; use "
            "write_through with this model"
        )
