"""Pure parts of the Mooncake backend: spec parsing, registered regions, chunking."""

from __future__ import annotations

import numpy as np
import pytest

from hicache.backends.mooncake_io import split_chunks
from hicache.backends.mooncake_memory import RegisteredRegions, address_of
from hicache.backends.mooncake_spec import parse_size, parse_spec


def test_spec_defaults_and_overrides() -> None:
    s = parse_spec("mooncake://10.0.0.5:50051?segment=1GiB&local_buffer=32MiB", {"lanes": 2})
    assert (s.master, s.protocol, s.segment, s.local_buffer, s.lanes) == ("10.0.0.5:50051", "tcp", 1 << 30, 32 << 20, 2)
    assert s.metadata == "http://10.0.0.5:8080/metadata"


@pytest.mark.parametrize("spec, words", [
    ("redis://x:1", "mooncake://"),
    ("mooncake://host", "HOST:PORT"),
    ("mooncake://h:1?protocol=udp", "protocol"),
    ("mooncake://h:1?protocol=rdma", "device"),
    ("mooncake://h:1?segment=lots", "segment"),
    ("mooncake://h:1?lanes=0", "lanes"),
    ("mooncake://h:1?colour=red", "unknown option"),
    ("mooncake://h:1?metadata=ftp://x", "metadata"),
])
def test_bad_specs_name_what_is_wrong(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_spec(spec)


def test_sizes() -> None:
    assert parse_size("4GB", "x") == 4 * 10**9 and parse_size("64MiB", "x") == 64 << 20 and parse_size(7, "x") == 7


def test_regions_cover_only_inside_one_region() -> None:
    r = RegisteredRegions()
    assert r.add(1000, 100) and r.add(5000, 10)
    assert not r.add(1010, 10)  # already covered
    assert r.covers(1000, 100) and r.covers(1050, 50) and not r.covers(1050, 51) and not r.covers(900, 10)
    with pytest.raises(ValueError, match="overlaps"):
        r.add(1090, 20)
    with pytest.raises(ValueError, match="nbytes"):
        r.add(8000, 0)
    r.check_integrity()
    assert r.ranges() == [(1000, 100), (5000, 10)]


def test_address_of_read_only_and_typed_views() -> None:
    a = np.arange(8, dtype=np.float32)
    assert address_of(memoryview(a)) == a.ctypes.data
    assert address_of(memoryview(a.tobytes())) != 0
    with pytest.raises(ValueError, match="contiguous"):
        address_of(memoryview(a)[::2])


def test_chunks_respect_batch_and_staging() -> None:
    assert split_chunks([10] * 5, [False] * 5, batch=2, staging=0) == [range(0, 2), range(2, 4), range(4, 5)]
    assert split_chunks([10, 10, 10], [True, False, True], batch=8, staging=15) == [range(0, 2), range(2, 3)]
    with pytest.raises(ValueError, match="register the host pool"):
        split_chunks([100], [True], batch=8, staging=99)
