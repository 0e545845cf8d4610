from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.backends.keys import Namespace
from hicache.radix.hashes import chain_page_hashes
from hicache.types import PageHash


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


BASE = dict(model="m", kv="mha:32:8:128:bfloat16", page_size=64)


def test_namespace_separates_every_field():
    variants = [
        Namespace(**BASE),
        Namespace(**{**BASE, "model": "m2"}),
        Namespace(**{**BASE, "kv": "mha:32:8:128:float8_e4m3fn"}),  # dtype
        Namespace(**{**BASE, "kv": "mha:32:4:128:bfloat16"}),  # geometry
        Namespace(**{**BASE, "kv": "mla:32:512:64:bfloat16"}),  # attention kind
        Namespace(**{**BASE, "page_size": 32}),
        Namespace(**BASE, tenant="acme"),
        Namespace(**BASE, rank=1),
    ]
    prefixes = [v.prefix for v in variants]
    assert len(set(prefixes)) == len(prefixes)
    h = PageHash("ab" * 32)
    assert all(v.key(h).startswith(v.prefix) and v.key(h).endswith(h) for v in variants)
    assert Namespace(**BASE).prefix == Namespace(**BASE).prefix  # deterministic


def test_rank_rules_mha_vs_mla():
    mha0, mha1 = Namespace(**BASE, rank=0), Namespace(**BASE, rank=1)
    assert mha0.prefix != mha1.prefix and mha0.writes and mha1.writes
    assert Namespace(**BASE).prefix == mha0.prefix  # no TP is rank 0
    mla = {**BASE, "kv": "mla:61:512:64:bfloat16"}
    ranks = [Namespace(**mla, rank=r) for r in (None, 0, 1, 7)]
    assert len({n.prefix for n in ranks}) == 1  # MLA keys carry no rank
    assert [n.writes for n in ranks] == [True, True, False, False]


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"model": ""}, "model"),
        ({"kv": "mha:32:8:128"}, "kv spec"),
        ({"kv": "gqa:32:8:128:bfloat16"}, "kv spec"),
        ({"kv": "mha:32:0:128:bfloat16"}, "dimensions positive"),
        ({"kv": "mha:32:8:128:bf16"}, "unknown dtype"),
        ({"page_size": 0}, "page_size"),
        ({"rank": -1}, "rank"),
        ({"tenant": None}, "tenant"),
    ],
)
def test_namespace_rejects_bad_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        Namespace(**{**BASE, **fields})


def test_key_and_page_hash_of():
    ns = Namespace(**BASE)
    h = chain_page_hashes(range(64), 64)[0]
    assert ns.page_hash_of(ns.key(h)) == h
    with pytest.raises(ValueError, match="page_hash"):
        ns.key("xyz")
    with pytest.raises(ValueError, match="not in namespace"):
        Namespace(**BASE, tenant="t").page_hash_of(ns.key(h))


def test_keys_of_a_batch_are_each_key_and_check_every_hash():
    ns = Namespace(**BASE)
    hashes = chain_page_hashes(range(64 * 5), 64)
    assert ns.keys(hashes) == [ns.key(h) for h in hashes]
    assert ns.keys([]) == []
    good = hashes[0]
    # One bad hash anywhere in a batch is named, whatever makes it bad (the batch check joins
    # the hashes: a short one next to a long one must not pass as two good ones).
    for bad in ("A" * 64, good[:63], good + "0", "g" * 64, 7, good[:32] + " " * 32):
        for at in (0, 2, 4):
            batch = list(hashes)
            batch[at] = bad
            with pytest.raises(ValueError, match="page_hash"):
                ns.keys(batch)
    short_long = [good[:60], good + good[:4]]  # joined, 128 hex characters
    with pytest.raises(ValueError, match="page_hash"):
        ns.keys(short_long)


def test_mha_keys_carry_tp_size_mla_keys_do_not():
    # With replicated KV heads, rank 0 of TP8 and rank 0 of TP16 hold different heads.
    tp8, tp16 = Namespace(**BASE, rank=0, tp_size=8), Namespace(**BASE, rank=0, tp_size=16)
    assert tp8.prefix != tp16.prefix
    h = PageHash("cd" * 32)
    assert tp8.key(h) != tp16.key(h)
    assert Namespace(**BASE).prefix == Namespace(**BASE, rank=0, tp_size=1).prefix  # no TP
    mla = {**BASE, "kv": "mla:61:512:64:bfloat16"}
    sizes = [Namespace(**mla, rank=0, tp_size=n) for n in (1, 2, 8, 16)] + [Namespace(**mla)]
    assert len({n.prefix for n in sizes}) == 1  # MLA keys carry neither rank nor size
    assert len({n.key(h) for n in sizes}) == 1


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": True}, "tp_size"),
        ({"tp_size": 2.0}, "tp_size"),
        ({"rank": 2, "tp_size": 2}, "rank"),
    ],
)
def test_namespace_rejects_bad_tp_size(fields, match):
    with pytest.raises(ValueError, match=match):
        Namespace(**{**BASE, **fields})
