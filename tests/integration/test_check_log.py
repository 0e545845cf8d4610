"""`hicache check-log`: green on the logs of deterministic runs, red on the same logs with a
state-changing event dropped or moved (renumbered, so that only the meaning gives it away)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.cli.checklog import Violation, check_events
from hicache.cli.checklog.command import check_file
from hicache.cli.main import main

TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_trace_400.jsonl"
BASE = ["replay", "--trace", str(TRACE), "--kv", "mha:1:1:8:float16", "--quiet", "--deterministic"]
DEVICE = 32768

SCENARIOS = {
    # L3 with wait_complete prefetches, write-through: loads, backups, uploads, prefetches
    "l3_write_through": [
        "--limit",
        "60",
        "--storage",
        "memory",
        "--device-tokens",
        "65536",
        "--host-tokens",
        "131072",
        "--seed",
        "3",
    ],
    # a small exclusive L2 under write-back: L1 evictions that wait for backups
    "exclusive": [
        "--limit",
        "40",
        "--storage",
        "none",
        "--exclusive",
        "--device-tokens",
        str(DEVICE),
        "--host-tokens",
        "65536",
        "--seed",
        "1",
    ],
    # best-effort prefetches stopped at once, a small L2: revoked and short prefetches
    "best_effort": [
        "--limit",
        "40",
        "--storage",
        "memory",
        "--prefetch-policy",
        "best_effort",
        "--write-policy",
        "write_back",
        "--device-tokens",
        str(DEVICE),
        "--host-tokens",
        "49152",
        "--seed",
        "7",
    ],
}


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, argv in SCENARIOS.items():
        path = tmp_path_factory.mktemp(name) / "events.jsonl"
        assert main([*BASE, *argv, "--events", str(path)]) == 0
        out[name] = path
    return out


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def restamp(events: list[dict], stamps: list[tuple]) -> list[dict]:
    """The events in their new order with the original (seq, t) sequence laid over them, so
    the framing checks pass and only what the events say can give a mutation away."""
    out = []
    for e, (seq, t) in zip(events, stamps):
        out.append({**e, "seq": seq, "t": t})
    return out


def dropped(events: list[dict], index: int) -> list[dict]:
    stamps = [(e["seq"], e["t"]) for e in events][:-1]
    return restamp(events[:index] + events[index + 1 :], stamps)


def moved(events: list[dict], src: int, dst: int) -> list[dict]:
    stamps = [(e["seq"], e["t"]) for e in events]
    order = list(events)
    e = order.pop(src)
    order.insert(dst, e)
    return restamp(order, stamps)


def first(events, name, **fields) -> int:
    for i, e in enumerate(events):
        if e["event"] == name and all(e.get(k) == v for k, v in fields.items()):
            return i
    raise LookupError(name)


def violation(events, **kw) -> str:
    with pytest.raises(Violation) as info:
        check_events(events, **kw)
    return str(info.value)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_real_logs_hold(logs, name, capsys):
    report = check_file(logs[name], device_tokens=65536 if name == "l3_write_through" else DEVICE)
    assert report.runs == 1 and report.matches > 0 and report.inserts > 0
    assert main(["check-log", str(logs[name])]) == 0
    assert "ok:" in capsys.readouterr().out


def test_the_scenarios_exercise_every_op_kind(logs):
    names = set()
    for path in logs.values():
        names |= {e["event"] for e in read(path)}
    assert names >= {
        "tree.load_started",
        "loader.load_done",
        "writer.backup_done",
        "uploader.stored",
        "tree.prefetch_started",
        "tree.prefetch_done",
        "tree.evict_device",
        "tree.evict_host",
        "actor.stopped",
    }


def test_an_asyncio_run_log_holds(tmp_path):
    path = tmp_path / "events.jsonl"
    argv = [a for a in BASE if a != "--deterministic"]
    assert main([*argv, *SCENARIOS["l3_write_through"], "--events", str(path)]) == 0
    check_file(path, device_tokens=65536)


def test_a_dropped_line_breaks_seq(logs, tmp_path, capsys):
    events = read(logs["l3_write_through"])
    i = first(events, "loader.load_done")
    path = tmp_path / "dropped.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events[:i] + events[i + 1 :]))
    assert main(["check-log", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"line {i + 1} (seq {i + 2}, " in out and "events are missing" in out


@pytest.mark.parametrize(
    "event, message",
    [
        ("tree.load_started", "never started"),
        ("loader.load_done", "no loader.load_done followed"),
        ("tree.prefetch_started", "never started"),
        ("tree.prefetch_done", "no tree.prefetch_done followed"),
        ("tree.match", "no match open"),
        ("actor.stopped", "never reported actor.stopped"),
        ("kernel.started", "outside kernel.started"),
        ("kernel.stopped", "no kernel.stopped"),
    ],
)
def test_a_dropped_event_is_caught(logs, event, message):
    events = read(logs["l3_write_through"])
    assert message in violation(dropped(events, first(events, event)), device_tokens=65536)


def test_every_dropped_load_prefetch_or_needed_match_is_caught(logs):
    """Not only the first: each one, anywhere in each log. A match is needed when a load,
    prefetch or insert of its request follows before the request's next match, and no match
    of it came before (a request that fell back from a step that did not fit was matched,
    released, matched again: releases have no event, so either match stands for both)."""
    for name in SCENARIOS:
        events = read(logs[name])
        for i, e in enumerate(events):
            if e["event"] == "tree.match":
                mine = [x["event"] for x in events if x.get("rid") == e["rid"]]
                later = [x for x in events[i + 1 :] if x.get("rid") == e["rid"]]
                if mine.count("tree.match") > 1 or not later or later[0]["event"] == "tree.match":
                    continue
            elif e["event"] not in (
                "tree.load_started",
                "loader.load_done",
                "tree.prefetch_started",
                "tree.prefetch_done",
            ):
                continue
            with pytest.raises(Violation):
                check_events(dropped(events, i))


@pytest.mark.parametrize("name", ["exclusive", "best_effort"])
def test_dropped_inserts_and_evictions_break_the_l1_count(logs, name):
    """With the L1 size given, the re-derived L1 count catches a dropped eviction when L1
    fills up again afterwards, and most dropped inserts (those later evictions take more of
    than the log put there); an event after the last eviction leaves no trace."""
    events = read(logs[name])
    last_eviction = max(i for i, e in enumerate(events) if e["event"] == "tree.evict_device")
    caught = {"tree.evict_device": [0, 0], "tree.insert": [0, 0]}
    for i, e in enumerate(events):
        if e["event"] not in caught or e.get("new") == 0 or i > last_eviction:
            continue
        caught[e["event"]][1] += 1
        try:
            check_events(dropped(events, i), device_tokens=DEVICE)
        except Violation as v:
            # an insert that ends its request also leaves that request open at close
            assert any(w in str(v) for w in ("device tokens", "L1", "locks at close"))
            caught[e["event"]][0] += 1
    evictions, inserts = caught["tree.evict_device"], caught["tree.insert"]
    assert evictions[1] > 10 and evictions[0] >= 0.7 * evictions[1]
    # A dropped insert shows only where later evictions take more than the log put in L1;
    # eviction takes just the shortfall, so not every one does.
    assert inserts[1] > 10 and inserts[0] >= 0.6 * inserts[1]


def test_reordered_events_are_caught(logs):
    events = read(logs["l3_write_through"])
    start = first(events, "tree.load_started")
    done = first(events, "loader.load_done", op=events[start]["op"])
    assert "never started" in violation(moved(events, done, start))
    backups = [i for i, e in enumerate(events) if e["event"] == "writer.backup_done"]
    assert "complete in issue order" in violation(moved(events, backups[1], backups[0]))
    pstart = first(events, "tree.prefetch_started")
    pdone = first(events, "tree.prefetch_done", op=events[pstart]["op"])
    assert "never started" in violation(moved(events, pdone, pstart))
    match = first(events, "tree.match", rid="r5")
    insert = first(events, "tree.insert", rid="r5")
    assert "without a match" in violation(moved(events, insert, match))
    stop = first(events, "kernel.stopped")
    actor = first(events, "actor.stopped")
    assert "never reported" in violation(moved(events, stop, actor))


def test_a_failed_run_and_garbage_are_reported(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"event":"kernel.started","seq":1,"t":0,"component":"kernel",'
        '"level":"info","actors":["tree"]}\nnot json\n'
    )
    assert main(["check-log", str(path)]) == 1
    assert "line 2: not JSON" in capsys.readouterr().out
    events = [
        {
            "event": "kernel.started",
            "seq": 1,
            "t": 0,
            "component": "kernel",
            "level": "info",
            "actors": [],
        },
        {
            "event": "kernel.stopped",
            "seq": 2,
            "t": 0,
            "component": "kernel",
            "level": "info",
            "reason": "failure",
        },
    ]
    assert "reason 'failure'" in violation(events)
    assert main(["check-log", str(tmp_path / "missing.jsonl")]) == 2


@pytest.mark.parametrize(
    "write_policy, exclusive, storage",
    [
        ("write_through", False, "memory"),
        ("write_back", True, None),
    ],
)
def test_the_rederived_l1_count_is_the_cache_s(write_policy, exclusive, storage):
    """The checker's L1 count, fed step by step, equals the tree's own after every step."""
    import anyio

    from hicache import CacheConfig, HiCache
    from hicache.cli.checklog.command import LogChecker
    from hicache.cli.replay.step import Timer, run_step
    from hicache.cli.tally import Tally
    from hicache.cli.trace import read_trace, scheduler_steps
    from hicache.observability import EventLog
    from hicache.results import CapacityError

    requests = read_trace(TRACE, limit=80)
    cfg = CacheConfig(
        kv="mha:1:1:8:float16",
        device_tokens=DEVICE,
        host_tokens=65536,
        write_policy=write_policy,
        exclusive=exclusive,
        storage=storage,
        model_id="m",
        prefetch_policy="wait_complete",
    )
    log = EventLog(capture=True)
    checker = LogChecker(device_tokens=DEVICE)

    async def run():
        compared = fed = 0
        async with HiCache(cfg, log=log) as cache:
            tally = Tally()
            for step in scheduler_steps(requests, 8, budget=DEVICE // 2):
                try:
                    await run_step(
                        cache, step, tally, Timer(tally), 512, False, storage is not None
                    )
                except CapacityError:
                    await cache.release_many(f"r{r.index}" for r in step)
                stats = await cache.stats()
                for e in log.events[fed:]:
                    checker.feed(e)
                fed = len(log.events)
                assert checker._device == stats.device.cached_tokens
                compared += 1
        for e in log.events[fed:]:
            checker.feed(e)
        checker.finish()
        return compared

    assert anyio.run(run) > 10


def test_a_close_that_leaves_slots_or_tables_behind_is_caught(logs):
    events = read(logs["l3_write_through"])
    at = first(events, "cache.closed")
    assert events[at]["used"] and not any(events[at]["used"].values())
    leaked = [dict(e) for e in events]
    leaked[at] = {**leaked[at], "used": {"device": 64, "host": 0}}
    assert "do not balance" in violation(leaked)
    left = [dict(e) for e in events]
    left[at] = {**left[at], "tables_left": {"writes": 1}}
    assert "not empty at close" in violation(left)


def test_slot_hand_outs_are_rederived_and_checked(logs):
    """Every slot the ledgers hand out or take back is in the log; a slot handed out twice
    (an alloc moved before the free that returned it), one taken back twice, or one never
    taken back by close is caught."""
    events = read(logs["l3_write_through"])
    report = check_events(events)
    assert report.slot_events > 0
    slots = [i for i, e in enumerate(events) if e["event"] == "tree.slots"]
    frees = [i for i in slots if events[i]["op"] == "free" and events[i]["tier"] == "device"]
    # Find a free whose first slot a later alloc hands out again, and move that alloc first.
    for f in frees:
        slot = events[f]["slots"][0][0]
        later = next(
            (
                i
                for i in slots
                if i > f
                and events[i]["op"] == "alloc"
                and events[i]["tier"] == "device"
                and any(a <= slot < b for a, b in events[i]["slots"])
            ),
            None,
        )
        if later is not None:
            break
    else:
        raise AssertionError("no slot is handed out again in this log")
    assert "handed out twice" in violation(moved(events, later, f))
    assert "handed out twice" in violation(dropped(events, f))
    duplicate = {**events[f]}
    twice = events[: f + 1] + [duplicate] + events[f + 1 :]
    stamps = [(i + 1, e["t"]) for i, e in enumerate(twice)]
    assert "not handed out" in violation(restamp(twice, stamps))
    last_alloc = max(i for i in slots if events[i]["op"] == "alloc")
    frees_after = [i for i in slots if i > last_alloc and events[i]["op"] == "free"]
    assert frees_after  # the drain gives everything back
    assert "never taken back" in violation(dropped(events, frees_after[-1]))


def test_every_request_ends_once(logs):
    """A request ends with a finished insert or a release (the drain releases what is left,
    `reason="close"`): one that ends twice, or is left open at close, is caught."""
    events = read(logs["l3_write_through"])
    finished = [
        i for i, e in enumerate(events) if e["event"] == "tree.insert" and e.get("finished", True)
    ]
    f = finished[0]
    release = {**events[f], "event": "tree.release", "reason": "caller"}
    twice = events[: f + 1] + [release] + events[f + 1 :]
    stamps = [(i + 1, e["t"]) for i, e in enumerate(twice)]
    assert "not open" in violation(restamp(twice, stamps))
    assert "locks at close" in violation(dropped(events, finished[-1]))
