"""The L3 defaults: `evict_to_storage` (a page leaving L1 reaches L3 under every write policy)
and the `timeout` prefetch policy, and a clear error for a bad `evict_to_storage`."""

from __future__ import annotations

import pytest

from hicache.config import CacheConfig, ConfigError


def test_the_defaults_send_evicted_pages_to_l3_and_wait_for_prefetches():
    cfg, rewrites = CacheConfig(storage="memory", model_id="m").resolve()
    assert cfg.evict_to_storage is True and cfg.prefetch_policy == "timeout"
    assert cfg.write_policy == "write_through_selective" and rewrites == ()


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_a_bad_evict_to_storage_is_named(bad):
    with pytest.raises(ConfigError, match=r"evict_to_storage=.* must be True or False"):
        CacheConfig(evict_to_storage=bad).resolve()
