"""Every inbox the cache builds has the bounds `Topology.edges()` declares, the one place of
every channel's capacity and reserve (docs/architecture.md, "Topology")."""

from __future__ import annotations

import pytest

from hicache import HiCache
from hicache.components.topology import Topology
from hicache.testing import run_virtual, virtual_config


@pytest.mark.parametrize("storage", [None, "memory"])
@pytest.mark.parametrize("capacity", [4, 64])
def test_every_inbox_has_its_declared_bounds(storage, capacity):
    async def main():
        cfg = virtual_config(channel_capacity=capacity, storage=storage, model_id="topology")
        async with HiCache(cfg) as cache:
            return {
                name: (actor.inbox.capacity, actor.inbox.reserve)
                for name, actor in cache.system.actors.items()
            }

    edges = Topology.for_capacity(capacity).edges()  # every worker, with or without storage
    assert run_virtual(main) == edges
