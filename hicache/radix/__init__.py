"""The radix tree: a paged prefix index over device (L1) and host (L2) KV slots (docs/tree.md).

`tree.RadixTree` is the class callers use. Its layers, one module each: `structure` (the nodes
and the facts kept about them, locks, queries, the integrity check), `eviction` (leaf-first
eviction from both tiers) and `tree` (match and insert, retention and pins, backups and loads
back); `results` holds what crosses the boundary (`TreeError`, `NodeState`, the records calls
return, slot arrays), `keys` turns token ids into the bytes the tree compares and `hashes`
chains the page hashes the tree keeps per node (a page's name in L3).
"""
