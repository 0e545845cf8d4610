"""The compiled page hash chain (pagehash.c over libcrypto) against hashlib's, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.kernels.native.pagehash import page_hasher
from hicache.radix import hashes
from hicache.radix.hashes import chain_page_hashes

needs_hasher = pytest.mark.skipif(page_hasher() is None, reason="compiled page hasher unavailable")


@pytest.fixture
def python_then_compiled():
    """Runs a body under the Python loop, then the compiled one; restores what was in use."""
    before = hashes.digest_loop()
    yield (None, page_hasher())
    hashes.use_digest_loop(before)


@needs_hasher
@pytest.mark.parametrize("seed", range(6))
def test_compiled_chain_matches_hashlib(seed, python_then_compiled):
    rng = np.random.default_rng(seed)
    page = int(rng.choice([1, 4, 16, 64]))
    bigram = seed % 3 == 2
    shape = (int(rng.integers(0, 9 * page)),) + ((2,) if bigram else ())
    tokens = rng.integers(0, 2**32, shape, dtype=np.int64)
    prior = chain_page_hashes(rng.integers(0, 2**32, page), page)[0] if seed % 2 else None
    results = []
    for loop in python_then_compiled:
        hashes.use_digest_loop(loop)
        results.append(chain_page_hashes(tokens, page, prior=prior))
    assert results[0] == results[1]
    assert len(results[0]) == shape[0] // page


@needs_hasher
def test_a_failing_loop_falls_back_to_python(python_then_compiled):
    tokens = np.arange(256, dtype=np.int64)
    hashes.use_digest_loop(None)
    expected = chain_page_hashes(tokens, 64)

    def broken(prior: bytes, raw: bytes, stride: int, pages: int) -> bytes:
        raise OSError("libcrypto refused")

    hashes.use_digest_loop(broken)
    assert chain_page_hashes(tokens, 64) == expected
