"""Small builders shared by the tree unit tests."""

import numpy as np

from hicache.policies.eviction import LRU
from hicache.policies.write import write_policy
from hicache.radix.tree import RadixTree


def make_tree(page_size=1, *, strategy=None, policy="write_through_selective", bigram=False):
    return RadixTree(
        page_size=page_size,
        eviction=strategy or LRU(),
        write_policy=write_policy(policy),
        bigram=bigram,
    )


class SlotSource:
    """Hands out fresh, never-repeated slot numbers (stands in for a ledger)."""

    def __init__(self, start=0):
        self.next = start

    def take(self, n):
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return out


def toks(*values):
    return np.array(values, dtype=np.uint32)
