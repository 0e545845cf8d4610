"""Redis / Valkey as the L3 tier (`redis://`, `rediss://`, `unix://`, `redis+cluster://`).

- backend.py: `RedisBackend`, the StorageBackend (keys, values, events, counters);
- spec.py: the spec string parsed into a `RedisSpec`;
- client.py: the redis.asyncio client and how its failures are classed;
- calls.py: batches cut into pipelines within the pool's permits, failures reported once;
- wire.py: commands written straight onto pooled connections, pages not joined;
- direct.py: page reads received in place into the caller's page memory (the connections
  and their reply reader);
- values.py: the framed value as pure functions over buffers.
"""

from hicache.backends.redis.backend import RedisBackend

__all__ = ["RedisBackend"]
