"""The compiled helpers of the data plane, built on first use with the system C compiler.

- build.py: building and caching the shared libraries (`HICACHE_NATIVE`, `HICACHE_CACHE_DIR`);
- rowcopy.py and rowcopy.c: the row copier the CPU engine and the ledgers use;
- pagehash.py and pagehash.c: the page hash chain in one call, for the radix core's hashes;
- addresses.py: numpy arrays' addresses as the compiled calls take them, cheaply.
"""
