"""A Mooncake storage process for tests and benchmarks: mounts a segment, says "ready", and
stays up until its stdin closes. Usage: storage_server.py MASTER METADATA_URL SEGMENT_BYTES"""

import os
import sys

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

from mooncake.store import MooncakeDistributedStore


def main() -> int:
    master, metadata, segment = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata, segment, 16 << 20, "tcp", "", master)
    if rc != 0:
        print(f"setup failed: {rc}", flush=True)
        return 1
    print("ready", flush=True)
    sys.stdin.read()  # parent closes stdin (or kills us) to stop
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
