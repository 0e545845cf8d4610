"""`CacheConfig.resolve()` is the one rule set for rewrites, and the names it accepts are the
ones their registries implement (docs/configuration.md, "Rewrites")."""

from __future__ import annotations

import pytest

from hicache import CacheConfig
from hicache.config import (
    EVICTION_POLICIES,
    IO_BACKENDS,
    LAYOUTS,
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    ConfigError,
)
from hicache.policies.eviction import make_strategy
from hicache.policies.write import write_policy


@pytest.mark.parametrize(
    "fields, changed",
    [
        (dict(io_backend="direct", layout="page_first"), dict(layout="page_first_direct")),
        (dict(exclusive=True), dict(write_policy="write_back")),
        (dict(exclusive=True, write_policy="write_back"), {}),
        # every other combination runs as asked (the transfer functions accept them all)
        (dict(io_backend="direct", layout="page_head"), {}),
        (dict(io_backend="direct", layout="layer_first"), {}),
        (dict(io_backend="kernel", layout="page_first_direct"), {}),
        (dict(layout="layer_first", storage="memory", model_id="m"), {}),
    ],
)
def test_rewrites(fields, changed):
    cfg, rewrites = CacheConfig(**fields).resolve()
    assert {r.field: r.new for r in rewrites} == changed
    assert all(
        r.old == fields.get(r.field, getattr(CacheConfig(), r.field)) and r.reason for r in rewrites
    )
    for name, value in {**fields, **changed}.items():
        assert getattr(cfg, name) == value


def test_page_head_with_mla_is_refused():
    with pytest.raises(ConfigError, match="page_head"):
        CacheConfig(kv="mla:2:8:4:float16", layout="page_head").resolve()


@pytest.mark.parametrize(
    "field, known",
    [
        ("eviction", EVICTION_POLICIES),
        ("write_policy", WRITE_POLICIES),
        ("prefetch_policy", PREFETCH_POLICIES),
        ("layout", LAYOUTS),
        ("io_backend", IO_BACKENDS),
    ],
)
def test_every_registered_name_is_accepted_and_no_other(field, known):
    for name in known:
        CacheConfig(**{field: name}).resolve()
    with pytest.raises(ConfigError) as raised:
        CacheConfig(**{field: "no-such-name"}).resolve()
    assert field in str(raised.value) and all(name in str(raised.value) for name in known)


def test_policy_names_build_their_policy():
    assert [make_strategy(name).name for name in EVICTION_POLICIES] == list(EVICTION_POLICIES)
    assert [write_policy(name).name for name in WRITE_POLICIES] == list(WRITE_POLICIES)
