"""The replay's link reference and utilization (hicache/cli/replay/link.py)."""

from __future__ import annotations

from hicache.cli.replay.link import LinkReference, link_utilization, measure_link


def test_a_host_reference_says_what_it_copied():
    ref = measure_link("cpu", nbytes=1 << 20)
    assert ref.rate > 0 and "host copy" in ref.what


def test_utilization_is_moved_over_wall_times_reference():
    ref = LinkReference(rate=50e9, what="stand-in")
    link = link_utilization(100 * 10**9, 4.0, ref)
    assert link == {
        "run_s": 4.0,
        "moved_gbps": 25.0,
        "reference_gbps": 50.0,
        "reference": "stand-in",
        "utilization": 0.5,
    }
    assert link_utilization(10, 0.0, ref)["utilization"] == 0.0


def test_auto_follows_the_driver(monkeypatch):
    from hicache.kernels import streams

    monkeypatch.setattr(streams, "cuda_driver_status", lambda: (False, "stand-in"))
    assert "host copy" in measure_link("auto", nbytes=1 << 16).what
