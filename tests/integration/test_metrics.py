"""Prometheus metrics: the exporter a cache starts for `metrics_port`, scraped over HTTP on
localhost and parsed with prometheus_client's own parser, against the replay's summary."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from pathlib import Path

import anyio
import pytest

from hicache import CacheConfig, ConfigError
from hicache.cli.main import main
from hicache.cli.replay.command import replay
from hicache.cli.replay.report import summarize
from hicache.cli.trace import read_trace
from hicache.observability import EventLog

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hicache.observability.metrics import CacheMetrics  # noqa: E402

TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_trace_400.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def samples(text: str) -> dict[str, list]:
    """Sample name -> [(labels, value)], parsed by prometheus_client."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def by_label(found: dict, name: str, label: str) -> dict:
    return {labels[label]: value for labels, value in found[name]}


def test_scraped_hit_counters_equal_the_replay_summary():
    requests = read_trace(TRACE, limit=60)
    port = free_port()
    cfg = CacheConfig(
        kv="mha:1:1:8:float16",
        page_size=64,
        device_tokens=131072,
        host_tokens=262144,
        storage="memory",
        model_id="replay",
        write_policy="write_through",
        prefetch_policy="wait_complete",
        metrics_port=port,
    )
    scraped: dict[str, str] = {}

    def at_last_step(tally):
        if tally.requests == len(requests):  # every hit is counted; the cache is still open
            scraped["text"] = scrape(port)

    tally, extra = anyio.run(
        lambda: replay(
            cfg,
            requests,
            block_tokens=512,
            batch=8,
            verify=False,
            log=None,
            progress=lambda n: None,
            on_step=at_last_step,
        )
    )
    summary = summarize(tally, extra, cfg, requests, block_tokens=512, storage="memory", wall=0)
    assert summary["rejected_requests"] == 0
    found = samples(scraped["text"])
    hits = by_label(found, "hicache_hit_tokens_total", "tier")
    # tier host counts every token loaded back from L2, L3's prefetched pages included; the
    # summary's "host" is what L2 held by itself
    assert hits["device"] == summary["hit_tokens"]["device"] > 0
    assert hits["storage"] == summary["hit_tokens"]["storage"] > 0
    assert hits["host"] - hits["storage"] == summary["hit_tokens"]["host"]
    queried = by_label(found, "hicache_queried_tokens_total", "tier")
    assert queried["device"] == summary["input_tokens"]
    assert queried["host"] == summary["input_tokens"] - hits["device"]
    assert queried["storage"] >= hits["storage"]
    capacity = by_label(found, "hicache_capacity_tokens", "tier")
    assert capacity == {"device": 131072, "host": 262144}
    used = by_label(found, "hicache_used_tokens", "tier")
    assert 0 < used["device"] <= 131072 and 0 < used["host"] <= 262144
    assert set(by_label(found, "hicache_mailbox_depth_messages", "actor")) == {
        "tree",
        "allocator",
        "writer",
        "loader",
        "uploader",
        "prefetcher",
    }
    assert set(by_label(found, "hicache_inflight_ops", "kind")) >= {
        "writes",
        "loads",
        "uploads",
        "prefetches",
    }
    nbytes = by_label(found, "hicache_transfer_bytes_total", "direction")
    assert nbytes["h2d"] == summary["bytes"]["h2d"] and nbytes["d2h"] > 0
    assert nbytes["s2h"] == hits["storage"] * 8 * 2 * 2  # 1 layer x 1 head x 8 dims x K,V x fp16
    durations = by_label(found, "hicache_transfer_duration_seconds_count", "direction")
    assert durations["d2h"] > 0 and durations["h2d"] > 0 and durations["s2h"] > 0
    for labels, _ in found["hicache_hit_tokens_total"]:
        assert labels["cache"] == "replay/rank0"
    with pytest.raises(urllib.error.URLError):  # the exporter stops with the cache
        scrape(port)


def test_replay_serves_metrics_while_it_runs(capsys):
    port = free_port()
    assert (
        main(
            [
                "replay",
                "--trace",
                str(TRACE),
                "--limit",
                "20",
                "--kv",
                "mha:1:1:8:float16",
                "--device-tokens",
                "65536",
                "--host-tokens",
                "131072",
                "--storage",
                "none",
                "--quiet",
                "--metrics-port",
                str(port),
            ]
        )
        == 0
    )
    assert f"http://localhost:{port}/metrics" in capsys.readouterr().err


def test_a_taken_port_fails_the_open_cleanly():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = CacheConfig(kv="mha:1:1:8:float16", device_tokens=4096, metrics_port=port)

        async def open_it():
            from hicache import HiCache

            async with HiCache(cfg):
                pass

        with pytest.raises(OSError):
            anyio.run(open_it)


@pytest.mark.parametrize("port", [-1, 65536, "9400", True])
def test_metrics_port_is_validated(port):
    with pytest.raises(ConfigError, match="metrics_port"):
        CacheConfig(metrics_port=port).resolve()


def test_events_drive_the_counters_without_a_cache():
    log = EventLog(capture=True, clock=lambda: 1.0)
    metrics = CacheMetrics(log=log, instance="unit", page_size=64, page_nbytes=1024)
    tree, writer = log.bind("tree"), log.bind("writer")
    tree.info("tree.match", rid="a", tokens=640, device_hit=128, host_hit=256)
    tree.info("tree.load_started", rid="a", op=1, tokens=256)
    tree.info("tree.evict_device", tokens=192, demoted=1, removed=0)
    writer.info(
        "writer.backup_done", op=2, tokens=64, bytes=4096, ok=True, error=None, seconds=0.002
    )
    writer.info(
        "writer.backup_done", op=3, tokens=64, bytes=4096, ok=False, error="boom", seconds=0.001
    )
    tree.info("tree.prefetch_started", rid="a", op=4, tokens=256)
    tree.info("tree.prefetch_done", rid="a", op=4, state="done", hit=256, read=128)
    log.bind("prefetcher").info("prefetcher.done", op=4, pages=4, hit=4, read=2)
    log.bind("storage").warning("storage.corrupt", key="k", reason="checksum")
    log.bind("uploader").warning("uploader.timeout", op=5, pages=1, timeout=1.0)
    found = samples(metrics.text())
    assert by_label(found, "hicache_hit_tokens_total", "tier") == {
        "device": 128.0,
        "host": 256.0,
        "storage": 128.0,
    }
    assert by_label(found, "hicache_queried_tokens_total", "tier") == {
        "device": 640.0,
        "host": 512.0,
        "storage": 256.0,
    }
    assert by_label(found, "hicache_evicted_tokens_total", "tier")["device"] == 192
    nbytes = by_label(found, "hicache_transfer_bytes_total", "direction")
    assert nbytes["d2h"] == 4096 and nbytes["s2h"] == 2 * 1024
    assert by_label(found, "hicache_failed_transfers_total", "direction") == {"d2h": 1.0}
    assert by_label(found, "hicache_storage_corrupt_values_total", "reason") == {"checksum": 1.0}
    assert by_label(found, "hicache_storage_timeouts_total", "op") == {"upload": 1.0}
    bandwidth = by_label(found, "hicache_transfer_bandwidth_bytes_per_second_sum", "direction")
    assert bandwidth["d2h"] == pytest.approx(4096 / 0.002)
    metrics.close()
    tree.info("tree.match", rid="b", tokens=64, device_hit=64, host_hit=0)  # no longer counted
    assert by_label(samples(metrics.text()), "hicache_hit_tokens_total", "tier")["device"] == 128


def test_a_listener_that_raises_does_not_break_the_log():
    log = EventLog(capture=True)
    seen = []
    log.add_listener(lambda e: 1 / 0)
    log.add_listener(lambda e: seen.append(e["event"]))
    log.emit("x.y", component="cache")
    assert seen == ["x.y"] and log.events[0]["event"] == "x.y"


def test_matches_are_counted_by_salt_class():
    log = EventLog(capture=True, clock=lambda: 1.0)
    metrics = CacheMetrics(log=log, instance="unit", page_size=64, page_nbytes=1024)
    tree = log.bind("tree")
    tree.info("tree.match", rid="a", tokens=640, device_hit=128, host_hit=0, salted=True)
    tree.info("tree.match", rid="b", tokens=320, device_hit=64, host_hit=0, salted=False)
    tree.info("tree.match", rid="c", tokens=64, device_hit=0, host_hit=0)  # an older log
    found = samples(metrics.text())["hicache_match_tokens_by_salt_class_total"]
    got = {(labels["salt_class"], labels["kind"]): value for labels, value in found}
    assert got == {
        ("salted", "queried"): 640.0,
        ("salted", "hit"): 128.0,
        ("shared", "queried"): 384.0,
        ("shared", "hit"): 64.0,
    }
