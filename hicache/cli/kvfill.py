"""Moved to `hicache.testing.kvfill` (the stand-in model is a library module the replay and
the test kit both use); this name stays only until every import has moved."""

from hicache.testing.kvfill import count_bad_pages, fill, page_seeds

__all__ = ["count_bad_pages", "fill", "page_seeds"]
