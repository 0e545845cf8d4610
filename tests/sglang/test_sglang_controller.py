"""SGLang's own `HiCacheController` driving hicache's backend on CPU: the controller attaches
it through the `dynamic` loader, its backup thread stores host pages, its prefetch thread
probes them and its prefetch I/O thread reads them into other host pages, through the
zero-copy calls (`interface_v1: 1`) and through the legacy ones. The test plays the
scheduler's part (it hands the prefetch its host pages and collects the acks)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sglang_cpu import MHA_LAYOUTS, cpu_standins, dynamic_extra, mha_host, sglang_missing

if sglang_missing() is not None:  # one line in the summary, not one per test
    pytest.skip(str(sglang_missing()), allow_module_level=True)

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

from hicache.integrations.sglang import HiCacheL3Storage

PAGE = 4
WAIT_S = 60  # a bound on each wait for a controller thread, not a timing


@pytest.fixture
def controller(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    cpu_standins()
    get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    )
    device = MHATokenToKVPool(
        64, PAGE, torch.bfloat16, 2, 8, 3, "cpu", False, start_layer=0, end_layer=2
    )
    allocator = PagedTokenToKVPoolAllocator(64, PAGE, torch.int64, "cpu", device, False)
    interface_v1, layout = request.param
    host = mha_host(layout, page_size=PAGE)
    extra = dynamic_extra(f"file:{tmp_path}", interface_v1=interface_v1)
    cc = HiCacheController(
        allocator,
        host,
        PAGE,
        None,
        threading.Event(),
        write_policy="write_through",
        io_backend="direct",
        storage_backend="dynamic",
        model_name="test/model",
        storage_backend_extra_config=extra,
    )
    yield cc
    cc.detach_storage_backend()
    get_parallel().clear_stamp()


def page(host: Any, slot: int) -> bytes:
    return bytes(host.get_data_page(slot, flat=True).contiguous().view(torch.uint8).numpy())


CASES = [(v1, layout) for v1 in (1, 0) for layout in MHA_LAYOUTS]


@pytest.mark.parametrize(
    "controller",
    CASES,
    ids=[f"{'interface_v1' if v1 else 'legacy'}-{layout}" for v1, layout in CASES],
    indirect=True,
)
def test_the_controller_backs_up_and_prefetches_through_hicache(controller: Any) -> None:
    cc = controller
    assert isinstance(cc.storage_backend, HiCacheL3Storage)
    zero_copy = bool(cc.storage_config.extra_config.get("interface_v1"))
    assert (cc.page_get_func == cc._page_get_zero_copy) is zero_copy
    host = cc.mem_pool_host
    tokens = list(range(100, 100 + 3 * PAGE))
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    src = host.alloc(3 * PAGE)
    cc.write_storage(src, tokens, hash_value=hashes)
    backed_up = cc.ack_backup_queue.get(timeout=WAIT_S)
    assert backed_up.completed_tokens == 3 * PAGE

    # a request whose first three pages are stored, then one that is not
    prefetch = cc.prefetch("req-1", tokens + list(range(7000, 7000 + PAGE)))
    hit = cc.prefetch_hit_queue.get(timeout=WAIT_S)
    assert hit is prefetch and hit.storage_hit_count == 3 * PAGE
    dst = host.alloc(3 * PAGE)
    hit.host_indices = dst
    cc.prefetch_buffer.put(hit)
    completed = 0
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=WAIT_S)
        if ack.completed_tokens is not None:
            completed = ack.completed_tokens
        if ack.completed_req:
            break
    assert completed == 3 * PAGE
    slots = lambda t: [int(i) for i in t[::PAGE]]  # noqa: E731
    assert [page(host, s) for s in slots(dst)] == [page(host, s) for s in slots(src)]
    assert cc.storage_backend.stats()["pages_read"] == 3
