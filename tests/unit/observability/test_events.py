"""EventLog: JSON lines, stable fields, capture, levels."""

import enum
import io
import json

import pytest
import structlog

from hicache.observability import EventLog, capture_events, configure_logging


class Tier(enum.Enum):
    L1 = 1


class Opaque:
    pass


def make_log(**kw):
    sink = io.StringIO()
    ticks = iter([1.0, 2.5, 2.5000004, 9.0])
    return sink, EventLog(clock=lambda: next(ticks), sink=sink, **kw)


def test_lines_are_sorted_json_with_seq_t_component():
    sink, log = make_log()
    log.emit("writer.batch_done", component="writer", op_id=3, tokens=64)
    log.bind("tree", node_id=5).warning("tree.split", at=2)
    lines = sink.getvalue().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert first == {
        "event": "writer.batch_done",
        "component": "writer",
        "level": "info",
        "seq": 1,
        "t": 1.0,
        "op_id": 3,
        "tokens": 64,
    }
    assert second["seq"] == 2 and second["t"] == 2.5 and second["node_id"] == 5
    assert second["level"] == "warning" and second["component"] == "tree"
    for line in lines:
        assert line == json.dumps(json.loads(line), sort_keys=True, separators=(",", ":"))


def test_values_render_without_addresses():
    sink, log = make_log()
    log.emit("x.y", component="c", tier=Tier.L1, ids={3, 1}, raw=b"\x01", thing=Opaque())
    event = json.loads(sink.getvalue())
    assert (event["tier"], event["ids"], event["raw"], event["thing"]) == (
        "L1",
        [1, 3],
        "01",
        "<Opaque>",
    )
    assert "0x" not in sink.getvalue()


def test_level_filtering_and_bad_input():
    sink, log = make_log(level="warning")
    log.emit("a.b", component="c")  # info: below the log's level
    log.emit("a.c", component="c", level="error")
    assert [json.loads(x)["event"] for x in sink.getvalue().splitlines()] == ["a.c"]
    with pytest.raises(ValueError, match="unknown log level"):
        log.emit("a.d", component="c", level="loud")
    with pytest.raises(ValueError, match="reserved"):
        log.emit("a.e", component="c", seq=3)
    with pytest.raises(ValueError, match="unknown log level"):
        EventLog(level="chatty")


def test_capture_events_and_capture_flag():
    log = EventLog(clock=lambda: 0.0, capture=True)
    with capture_events() as outer:
        log.emit("one", component="c")
        with capture_events() as inner:
            log.emit("two", component="c")
    log.emit("three", component="c")
    assert [e["event"] for e in outer] == ["one", "two"]
    assert [e["event"] for e in inner] == ["two"]
    assert [e["event"] for e in log.events] == ["one", "two", "three"]
    with pytest.raises(RuntimeError, match="capture=True"):
        _ = EventLog().events


def test_configure_logging_writes_json_lines_to_the_sink():
    sink = io.StringIO()
    try:
        log = configure_logging(sink=sink, clock=lambda: 4.0)
        log.emit("kernel.started", component="kernel")
        structlog.get_logger().info("app.event", k=1)
    finally:
        structlog.reset_defaults()
    first, second = (json.loads(x) for x in sink.getvalue().splitlines())
    assert first["event"] == "kernel.started" and first["t"] == 4.0
    assert second == {"event": "app.event", "k": 1, "level": "info"}
