"""Child process: write pages 0..N-1 of tenant T through MooncakeBackend, then say "done".
Usage: writer.py SPEC TENANT N SALT"""

import sys

import anyio
import numpy as np
from mc_support import namespace, page_content, page_hash

from hicache.backends.mooncake import MooncakeBackend


async def main(spec: str, tenant: str, n: int, salt: str) -> None:
    ns = namespace(tenant)
    backend = MooncakeBackend.from_spec(spec, namespace=ns)
    pool = np.stack([page_content(i) for i in range(n)])
    backend.register_host_memory(pool.ctypes.data, pool.nbytes)
    keys = [ns.key(page_hash(i, salt)) for i in range(n)]
    stored = await backend.set_from(keys, [[memoryview(pool[i])] for i in range(n)])
    await backend.aclose()
    print(f"done {stored}", flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
