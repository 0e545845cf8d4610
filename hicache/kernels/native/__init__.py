"""The compiled helpers of the data plane, built on first use with the system C compiler.

- build.py: building and caching the shared libraries (`HICACHE_NATIVE`, `HICACHE_CACHE_DIR`);
- rowcopy.py and rowcopy.c: the row copier the CPU engine and the ledgers use;
- addresses.py: numpy arrays' addresses as the compiled calls take them, cheaply.
"""
