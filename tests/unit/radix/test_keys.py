"""The key codec: token ids to the bytes the radix tree compares, with or without a faster
int64 conversion handed in (the compiled one where it builds)."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.kernels.native.rowcopy import u32_ids
from hicache.radix.keys import KeyCodec
from hicache.radix.results import TreeError


@pytest.mark.parametrize("convert", [None, u32_ids, lambda ids: None])
def test_a_converter_changes_nothing_but_the_speed(convert):
    codec = KeyCodec(page_size=4, bigram=False, u32_ids=convert)
    ids = np.arange(10, dtype=np.int64) * 1000
    out = codec.encode(ids)
    assert out.dtype == np.uint32 and out.tolist() == ids.tolist()
    with pytest.raises(TreeError, match="outside"):
        codec.encode(np.array([1, -1, 3], dtype=np.int64))
    with pytest.raises(TreeError, match="outside"):
        codec.encode(np.array([1, 2**32], dtype=np.int64))


def test_bigram_keys_never_use_the_converter():
    def refuse(ids: np.ndarray) -> np.ndarray | None:
        raise AssertionError("a bigram key went to the int64 converter")

    codec = KeyCodec(page_size=2, bigram=True, u32_ids=refuse)
    out = codec.encode(np.array([[1, 2], [3, 4]], dtype=np.int64))
    assert codec.decode(out.tobytes()).tolist() == [[1, 2], [3, 4]]
