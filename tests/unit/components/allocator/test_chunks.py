"""The allocator's chunk plan: the host pool in whole-page chunks, in order."""

import pytest

from hicache.components.allocator.chunks import chunk_plan


def test_chunk_plan_covers_the_pool_in_whole_page_chunks():
    assert chunk_plan(40, 4, 3) == [(0, 12), (12, 24), (24, 36), (36, 40)]
    assert chunk_plan(8, 4, 5) == [(0, 8)]
    assert chunk_plan(0, 4, 1) == []
    with pytest.raises(ValueError, match="chunk_pages"):
        chunk_plan(8, 4, 0)
