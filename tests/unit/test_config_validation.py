"""`CacheConfig.resolve()` rejects every field value that cannot run, naming the field and the
value; and a cache with `tp_size > 1` but no process group refuses to open."""

from __future__ import annotations

import math

import anyio
import pytest

from hicache import CacheConfig, HiCache
from hicache.config import ConfigError

NAN, INF = math.nan, math.inf

BAD = [
    # bool is an int in Python; none of these means a count
    ("page_size", True),
    ("device_tokens", True),
    ("host_tokens", True),
    ("channel_capacity", True),
    ("storage_batch_pages", True),
    ("load_back_threshold", True),
    ("prefetch_threshold", False),
    ("upload_retries", True),
    ("max_upload_backlog", True),
    ("seed", True),
    ("tp_rank", False),
    ("tp_size", True),
    # ints that are not ints
    ("device_tokens", 64.0),
    ("host_tokens", 256.0),
    ("load_back_threshold", 1.5),
    ("prefetch_threshold", "256"),
    ("upload_retries", 1.0),
    ("upload_retries", -1),
    ("max_upload_backlog", -1),
    ("max_upload_backlog", 2.0),
    ("host_chunk_bytes", -1),
    ("host_chunk_bytes", 1.5),
    ("host_chunk_bytes", True),
    ("host_chunk_bytes", "256MiB"),
    ("seed", 1.5),
    ("seed", "0"),
    ("tp_rank", 0.0),
    ("tp_size", 0),
    ("tp_size", 2.0),
    # durations: finite and >= 0
    ("upload_backoff", NAN),
    ("upload_backoff", INF),
    ("upload_backoff", -0.1),
    ("upload_backoff", "0.05"),
    ("prefetch_timeout_base", NAN),
    ("prefetch_timeout_base", INF),
    ("prefetch_timeout_base", -1.0),
    ("prefetch_timeout_per_ki_token", NAN),
    ("prefetch_timeout_per_ki_token", -INF),
    ("prefetch_timeout_per_ki_token", -0.25),
    # deadlines: finite and > 0
    ("storage_timeout", 0),
    ("storage_timeout", -1.0),
    ("storage_timeout", NAN),
    ("storage_timeout", INF),
    ("storage_timeout", True),
    ("close_timeout", 0.0),
    ("close_timeout", NAN),
    ("close_timeout", INF),
    ("close_timeout", None),
    # bandwidth: > 0 (inf allowed: instant)
    ("transfer_bandwidth", 0),
    ("transfer_bandwidth", -1e9),
    ("transfer_bandwidth", NAN),
    ("transfer_bandwidth", True),
    ("prefetch_rate_fraction", NAN),
    ("prefetch_rate_fraction", True),
    ("extra", None),
    ("extra", [("store", 1)]),
    ("model_id", ""),
    ("model_id", 7),
    ("tenant", None),
]


@pytest.mark.parametrize("field, value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_value_is_rejected_naming_field_and_value(field, value):
    with pytest.raises(ConfigError) as raised:
        CacheConfig(**{field: value}).resolve()
    message = str(raised.value)
    assert field in message
    assert repr(value) in message


GOOD = [
    ("upload_backoff", 0),
    ("upload_backoff", 0.5),
    ("prefetch_timeout_base", 0.0),
    ("prefetch_timeout_per_ki_token", 2),
    ("upload_retries", 0),
    ("max_upload_backlog", 0),
    ("storage_timeout", 0.001),
    ("close_timeout", 5),
    ("transfer_bandwidth", INF),
    ("transfer_bandwidth", 1),
    ("seed", -3),
    ("load_back_threshold", 0),
    ("extra", {"threads": 0}),
]


@pytest.mark.parametrize("field, value", GOOD, ids=[f"{f}={v!r}" for f, v in GOOD])
def test_good_value_is_accepted(field, value):
    cfg, _ = CacheConfig(**{field: value}).resolve()
    assert getattr(cfg, field) == value


def test_tp_rank_and_size_checked_together():
    CacheConfig(tp_rank=3, tp_size=4).resolve()
    with pytest.raises(ConfigError, match="tp_rank=4"):
        CacheConfig(tp_rank=4, tp_size=4).resolve()


@pytest.mark.parametrize(
    "storage", ["memory", "file:/nonexistent/hicache", "redis://localhost:6379"]
)
def test_storage_needs_a_model_id(storage):
    with pytest.raises(ConfigError, match="model_id") as raised:
        CacheConfig(storage=storage).resolve()
    assert storage in str(raised.value)
    cfg, _ = CacheConfig(storage=storage, model_id="llama-3-8b").resolve()
    assert cfg.model_id == "llama-3-8b"


def test_without_storage_the_default_model_id_is_fine():
    CacheConfig().resolve()
    CacheConfig(storage=None).resolve()


# ---------------------------------------------------------------- tp_size > 1 without a group


def test_tp_without_process_group_refuses_to_open():
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    cfg = CacheConfig(
        kv="mha:2:1:8:float32",
        page_size=4,
        device_tokens=64,
        host_tokens=256,
        device="cpu",
        cpu_transfers="thread",
        tp_rank=1,
        tp_size=2,
    )

    async def main():
        async with HiCache(cfg):
            pass

    with pytest.raises(ConfigError, match="tp_size=2") as raised:
        anyio.run(main)
    assert "init_process_group" in str(raised.value)
    import threading

    assert not [
        t
        for t in threading.enumerate()  # no stream thread leaked (the checksum
        if t.name.startswith("hicache-") and not t.name.startswith("hicache-crc")
    ]  # pool stays)
