"""`HiCacheConnector`: vLLM's KV connector (v1) interface, dispatched to the half this process
runs (`SchedulerSide` or `WorkerSide`)."""

from __future__ import annotations

from typing import Any, cast

from hicache.integrations.vllm.compat import ConnectorBase, HMABase, TransferResults, log
from hicache.integrations.vllm.groups import check_policies
from hicache.integrations.vllm.layout import geometry_of, namespace_of
from hicache.integrations.vllm.metrics import EventLog, HiCachePromMetrics, HiCacheStats
from hicache.integrations.vllm.options import default_host_bytes, parse_options
from hicache.integrations.vllm.plan import HiCacheMetadata, HiCacheWorkerMetadata
from hicache.integrations.vllm.scheduler import SchedulerSide
from hicache.integrations.vllm.storage import Storage
from hicache.integrations.vllm.worker import WorkerSide


def _tp(vllm_config: Any) -> tuple[int, int]:
    """(this worker's TP rank, TP size)."""
    size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    if size == 1:
        return 0, 1
    try:
        import importlib

        state = importlib.import_module("vllm.distributed.parallel_state")
        return int(state.get_tensor_model_parallel_rank()), size
    except (ImportError, AssertionError, AttributeError):
        return 0, size


class HiCacheConnector(HMABase, ConnectorBase):
    """vLLM KV connector v1 over hicache's L2 (host pool) and L3 (storage backends). Takes
    vLLM's hybrid KV cache manager's groups (`SupportsHMA`): full attention and sliding
    window groups (groups.py)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        cast(Any, super()).__init__(
            vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config
        )
        if kv_cache_config is None:
            raise ValueError("HiCacheConnector needs vLLM's kv_cache_config (vLLM >= 0.11)")
        transfer = vllm_config.kv_transfer_config
        self.options = parse_options(getattr(transfer, "kv_connector_extra_config", None))
        self.geometry = geometry_of(vllm_config, kv_cache_config)
        check_policies(self.options.write_policy, self.geometry)
        rank, tp_size = _tp(vllm_config)
        model_id = self.options.model_id or str(vllm_config.model_config.model)
        host_bytes = self.options.host_bytes or default_host_bytes(
            self.options.host_fraction, tp_size
        )
        host_slots = max(1, host_bytes // self.geometry.page_bytes)
        self.is_scheduler = getattr(role, "name", str(role)).upper().endswith("SCHEDULER")
        storage = None
        if self.options.storage is not None:
            ns = namespace_of(
                self.geometry, model_id, rank=0 if self.is_scheduler else rank, tp_size=tp_size
            )
            storage = Storage(self.options.storage, ns, self.options)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if self.is_scheduler:
            kv_events = getattr(vllm_config, "kv_events_config", None)
            events = EventLog(
                bool(getattr(kv_events, "enable_kv_cache_events", False)),
                self.geometry.block_size,
                tp_size,
            )
            self.scheduler = SchedulerSide(
                self.options, self.geometry, host_slots, storage, events, tp_size=tp_size
            )
        else:
            self.worker = WorkerSide(
                self.options, self.geometry, int(kv_cache_config.num_blocks), storage
            )
        log.info(
            "HiCacheConnector %s: L2 %d slots x %d B, L3 %s",
            "scheduler" if self.is_scheduler else f"worker rank {rank}",
            host_slots,
            self.geometry.page_bytes,
            self.options.storage or "off",
        )

    # -- scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> HiCacheMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.scheduler is not None:
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if meta is not None:
                self.scheduler.worker_feedback(meta)
            self.scheduler.loads_failed(getattr(connector_output, "failed_recving", None))
            self.scheduler.loads_ended(getattr(connector_output, "finished_recving", None))

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            return self.scheduler.request_finished(request, (block_ids,)), None
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """`SupportsHMA`: as `request_finished`, with one block list per group."""
        if self.scheduler is not None:
            return self.scheduler.request_finished(request, block_ids), None
        return False, None

    def reset_cache(self) -> bool | None:
        if self.scheduler is not None:
            self.scheduler.reset()
            return True
        return None

    # -- worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = cast(Any, self)._get_connector_metadata()
        assert isinstance(meta, HiCacheMetadata)
        self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # wait_for_save copies every layer's computed pages after the forward

    def wait_for_save(self) -> None:
        assert self.worker is not None
        if not cast(Any, self).has_connector_metadata():
            return
        meta = cast(Any, self)._get_connector_metadata()
        assert isinstance(meta, HiCacheMetadata)
        self.worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(Write-back requests whose stores ran, asynchronous loads that ended)."""
        if self.worker is None:
            return None, None
        sending, recving = self.worker.poll(set(finished_req_ids))
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """`get_finished`, plus the requests whose load failed (several groups: vLLM takes
        load errors of a hybrid model per request; they are in `finished_recving` too, as
        every ended load is)."""
        sending, recving = self.get_finished(finished_req_ids)
        ended = set(recving or ())
        # Only an asynchronous load's request (ended in this poll) can fail; a hybrid model's
        # loads all are.
        failed = (self.worker.take_failed() if self.worker is not None else set()) & ended
        return TransferResults(
            finished_sending=set(sending or ()), finished_recving=ended, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> HiCacheWorkerMetadata | None:
        if self.worker is None:
            return None
        bad = self.worker.take_bad()
        done, failed = self.worker.take_uploads()
        prefetched = self.worker.loads.take_prefetched()
        if not (bad or done or failed or prefetched):
            return None
        meta = HiCacheWorkerMetadata(bad)
        meta.uploaded = dict.fromkeys(done, 1)
        meta.upload_failed = set(failed)
        meta.prefetched = prefetched
        return meta

    # -- metrics and events (hicache.integrations.vllm.metrics; docs/vllm.md)
    def get_kv_connector_stats(self) -> HiCacheStats | None:
        """The increments since the last call, on either half (vLLM sums both)."""
        if self.worker is not None:
            delta = self.worker.stats.take()
        elif self.scheduler is not None:
            delta = self.scheduler.take_stats()
        else:
            return None
        return HiCacheStats(dict(delta)) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HiCacheStats:
        return HiCacheStats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> HiCachePromMetrics:
        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> list[Any]:
        return self.scheduler.events.take() if self.scheduler is not None else []

    def shutdown(self) -> None:
        if self.worker is not None:
            log.info("HiCacheConnector worker stats: %s", self.worker.stats.totals)
            self.worker.shutdown()
        if self.scheduler is not None:
            log.info("HiCacheConnector scheduler stats: %s", self.scheduler.stats.totals)
            if self.scheduler.storage is not None:
                self.scheduler.storage.close()
                self.scheduler.storage = None
