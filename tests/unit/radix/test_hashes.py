"""Page hashes (hicache/radix/hashes.py): the chain against a per-token reference, a known
vector, prefixes and priors, bigram tuples, and the inputs refused."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.radix.hashes import chain_page_hashes


def reference_hashes(tokens, page_size, prior=None):
    """Per-token reference: SHA256(prev || ids as u32 LE)."""
    out, prev = [], bytes.fromhex(prior) if prior else b""
    for p in range(len(tokens) // page_size):
        h = hashlib.sha256(prev)
        for t in tokens[p * page_size : (p + 1) * page_size]:
            for i in t if isinstance(t, tuple) else (t,):
                h.update(i.to_bytes(4, "little"))
        prev = h.digest()
        out.append(prev.hex())
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(1, 8))
def test_matches_per_token_reference(tokens, page_size):
    assert chain_page_hashes(tokens, page_size) == reference_hashes(tokens, page_size)


def test_known_vector():
    expected = hashlib.sha256(b"\x01\x00\x00\x00\x02\x00\x00\x00").hexdigest()
    assert chain_page_hashes([1, 2, 3], 2) == [expected]


def test_chaining_prefix_and_prior():
    tokens = list(range(12))
    full = chain_page_hashes(tokens, 4)
    assert len(full) == 3 and len(set(full)) == 3
    assert chain_page_hashes(tokens[:8], 4) == full[:2]  # a prefix's hashes are a prefix
    assert chain_page_hashes(tokens[4:], 4, prior=full[0]) == full[1:]
    # same tokens after a different prefix hash differently
    assert chain_page_hashes([9, 9, 9, 9] + tokens[4:8], 4)[1] != full[1]


def test_partial_page_ignored_and_numpy_equivalent():
    assert chain_page_hashes([1, 2, 3], 4) == []
    assert chain_page_hashes(np.arange(10, dtype=np.int64), 5) == chain_page_hashes(
        list(range(10)), 5
    )
    assert chain_page_hashes(np.arange(10, dtype=np.int32), 5) == chain_page_hashes(
        list(range(10)), 5
    )


def test_bigram_tuples():
    pairs = [(1, 2), (3, 4), (5, 6), (7, 8)]
    assert chain_page_hashes(pairs, 2) == reference_hashes(pairs, 2)
    assert chain_page_hashes(pairs, 2) != chain_page_hashes([1, 3, 5, 7], 2)


@pytest.mark.parametrize(
    "tokens, page_size, prior, match",
    [
        ([1, 2], 0, None, "page_size"),
        ([1, 2], True, None, "page_size"),
        ([-1, 2], 1, None, "32 bits"),
        ([2**32], 1, None, "32 bits"),
        ([1.5, 2.0], 1, None, "integers"),
        ([(1, 2), (3,)], 1, None, "equal-length"),
        ([1, 2], 1, "abc", "prior"),
        ([1, 2], 1, "A" * 64, "prior"),
    ],
)
def test_bad_input(tokens, page_size, prior, match):
    with pytest.raises(ValueError, match=match):
        chain_page_hashes(tokens, page_size, prior=prior)
