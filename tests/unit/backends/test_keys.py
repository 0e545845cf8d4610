"""L3 keys (hicache/backends/keys.py): a page hash under a namespace that separates every
field, the rank rules of MHA and MLA, and the keys of a batch."""

from __future__ import annotations

import pytest

from hicache.backends.keys import Namespace
from hicache.radix.hashes import chain_page_hashes
from hicache.types import PageHash

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


def test_page_hashes_of_a_batch_match_one_key_at_a_time_and_name_a_bad_suffix():
    ns = Namespace(model="m", kv="mha:1:1:4:float16", page_size=4)
    keys = ns.keys(chain_page_hashes(list(range(12)), 4))
    assert ns.page_hashes_of(keys) == [ns.page_hash_of(k) for k in keys]
    bad = ns.prefix + "Z" * 64
    with pytest.raises(ValueError, match="Z" * 64):
        ns.page_hashes_of([keys[0], bad])


@pytest.mark.parametrize(
    "bad",
    [
        ["a" * 63, "a" * 65],  # the right total, wrong lengths
        ["A" * 64],  # upper case
        ["g" * 64],
        ["é" * 64],
        [b"a" * 64],  # bytes, not str
        ["a" * 64, None],
    ],
)
def test_a_batch_with_one_bad_hash_is_refused_and_named(bad):
    ns = Namespace(model="m", page_size=4, kv="mha:1:1:8:float16")
    with pytest.raises((ValueError, TypeError)):
        ns.keys(bad)
    good = "0123456789abcdef" * 4
    assert ns.keys([good, good]) == [ns.prefix + good] * 2
    assert ns.page_hashes_of(ns.keys([good])) == [good]
