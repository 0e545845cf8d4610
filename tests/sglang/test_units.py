"""The SGLang storage backend's parts that need no SGLang (these run in every venv): the extra
config's checks, SGLang keys as hicache page hashes, a host pool's pages as byte ranges, and
the backend over a stand-in pool with SGLang's page methods."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hicache.integrations.sglang import HiCacheL3Storage, PageMap, parse_options, storage_hash
from hicache.integrations.sglang.options import load_seal


class LayerFirstPool:
    """SGLang's MHA host pool's page methods over a `layer_first` buffer
    [K/V, layer, token, head, dim], as SGLang defines them."""

    def __init__(self, *, tokens: int = 32, page_size: int = 4, layers: int = 3) -> None:
        self.page_size, self.layer_num, self.head_num, self.head_dim = page_size, layers, 2, 4
        self.dtype, self.layout = torch.float16, "layer_first"
        self.kv_buffer = torch.randn(2, layers, tokens, 2, 4).to(torch.float16)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2, self.layer_num, self.page_size, 2, 4, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, page: torch.Tensor) -> None:
        self.kv_buffer[:, :, index : index + self.page_size] = page.reshape(
            2, self.layer_num, self.page_size, 2, 4
        )


class CopiedPool(LayerFirstPool):
    """A pool whose page is built by copying (as SGLang's Mamba pool builds it)."""

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return super().get_data_page(index, flat=True).clone()


def config(extra: dict[str, Any], **kw: Any) -> Any:
    fields = dict(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        model_name="test/model",
        extra_config=extra,
    )
    fields.update(kw)
    return SimpleNamespace(**fields)


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


def test_the_extra_config_is_checked_naming_what_is_wrong() -> None:
    ok = parse_options({"storage": "memory", "interface_v1": 1, "backend_name": "x"})
    assert ok.storage == "memory" and ok.storage_timeout == 30.0
    for extra, needle in [
        ({}, "storage must be"),
        (
            {"storage": "memory", "salt_requests": True},
            r"unknown extra config keys \['salt_requests'\]",
        ),
        ({"storage": "ftp://x"}, "unknown storage spec"),
        ({"storage": "memory", "storage_timeout": "soon"}, "storage_timeout"),
        ({"storage": "memory", "storage_options": [1]}, "storage_options"),
        ({"storage": "memory", "encrypt_at_rest": "yes"}, "encrypt_at_rest"),
        ({"storage": "memory", "model_id": ""}, "model_id"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse_options(extra)
    with pytest.raises(ValueError, match="needs a secret"):
        load_seal(parse_options({"storage": "memory", "encrypt_at_rest": True}))
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load_seal(parse_options({"storage": "memory", "secret": "short"}))


def test_sglang_keys_become_page_hashes() -> None:
    h = "AB" * 32
    assert storage_hash(h) == h.lower()
    other = storage_hash("page-1")
    assert len(other) == 64 and other != storage_hash("page-2")
    assert storage_hash("zz" * 32) != "zz" * 32


@pytest.mark.parametrize("pool_cls", [LayerFirstPool, CopiedPool])
def test_a_page_s_byte_ranges_are_its_flat_page(pool_cls: type[LayerFirstPool]) -> None:
    pool = pool_cls()
    pages = PageMap(pool)
    assert pages.zero_copy is (pool_cls is LayerFirstPool)
    assert pages.page_bytes == pool.get_dummy_flat_data_page().numel() * 2
    if pages.zero_copy:
        pieces = pages.pieces(8)
        assert len(pieces) == 2 * pool.layer_num  # one per layer and K/V
        assert b"".join(bytes(p) for p in pieces) == raw(pool.get_data_page(8))
        pieces[0][:2] = b"\x00\x00"  # the pieces are the pool's memory
        assert raw(pool.kv_buffer[0, 0, 8])[:2] == b"\x00\x00"


@pytest.mark.parametrize("pool_cls", [LayerFirstPool, CopiedPool])
def test_pages_round_trip_through_a_stand_in_pool(pool_cls: type[LayerFirstPool]) -> None:
    pool = pool_cls()
    backend = HiCacheL3Storage(config({"storage": "memory", "salt": "t"}))
    try:
        backend.register_mem_pool_host(pool)
        keys = ["a" * 64, "b" * 64]
        assert backend.batch_set_v1(keys, torch.arange(0, 8)) == [True, True]
        assert backend.batch_get_v1([*keys, "c" * 64], torch.arange(16, 28)) == [True, True, False]
        assert raw(pool.get_data_page(16)) == raw(pool.get_data_page(0))
        assert raw(pool.get_data_page(20)) == raw(pool.get_data_page(4))
        assert backend.batch_exists([*keys, "c" * 64]) == 2
        assert backend.batch_get_v1(keys, torch.arange(0, 4)) == [False, False], "too few indices"
        result = backend.batch_exists_v2(keys, [])
        assert (result.kv_hit_pages, result.restorable_prefix_pages) == (2, [1, 2])
        assert backend.clear() is True and backend.batch_exists(keys) == 0
    finally:
        backend.close()


def test_without_a_model_name_the_start_fails_naming_model_id() -> None:
    with pytest.raises(ValueError, match="model_id"):
        HiCacheL3Storage(config({"storage": "memory"}, model_name=None))
    with pytest.raises(ValueError, match="tp_lcm_size"):
        HiCacheL3Storage(config({"storage": "memory"}, should_split_heads=True))


def test_calls_after_close_are_misses() -> None:
    pool = LayerFirstPool()
    backend = HiCacheL3Storage(config({"storage": "memory"}))
    backend.register_mem_pool_host(pool)
    assert backend.batch_set_v1(["a" * 64], torch.arange(0, 4)) == [True]
    backend.close()
    backend.close()  # idempotent
    assert backend.batch_get_v1(["a" * 64], torch.arange(8, 12)) == [False]
    assert backend.batch_exists(["a" * 64]) == 0
    assert backend.batch_set(["a" * 64], [pool.get_data_page(0)]) is False


def test_every_difference_in_a_pool_gives_other_keys() -> None:
    from hicache.integrations.sglang import pool_namespace

    pool = LayerFirstPool()

    def digest(p: Any = pool, name: str = "kv", salt: str = "", **kw: Any) -> str:
        ns = pool_namespace(
            p, name, config=config({}, **kw), model="m", salt=salt, seal=None, page_bytes=96
        )
        return ns.digest

    base = digest()
    others = [
        digest(pp_rank=1, pp_size=2),
        digest(tp_rank=1, tp_size=2),
        digest(tp_size=2),
        digest(attn_cp_rank=1, attn_cp_size=2),
        digest(salt="tenant"),
        digest(name="mamba"),
    ]
    paged = LayerFirstPool()
    paged.layout = "page_first"
    others.append(digest(paged))
    wide = LayerFirstPool()
    wide.dtype = torch.bfloat16
    others.append(digest(wide))
    assert len({base, *others}) == len(others) + 1

    mla = LayerFirstPool()
    mla.kv_lora_rank, mla.qk_rope_head_dim = 16, 8
    assert digest(mla, tp_rank=0, tp_size=2) == digest(mla, tp_rank=1, tp_size=2), "MLA: one copy"
    assert digest(mla) != base
