"""`hicache replay` with a planted secret and a planted password: neither appears in its
stdout, stderr, event log or `--json` summary, and the summary says the store is keyed."""

from __future__ import annotations

import json
from pathlib import Path

from hicache.cli.main import main
from hicache.cli.replay.report import summarize
from hicache.cli.tally import Tally
from hicache.config import CacheConfig

PLANT = "Plant3d-S3cr3t-Valu3-9f8e7d"
ENV = "HICACHE_TEST_PLANTED_SECRET"
TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_trace_400.jsonl"
SMALL = ["--trace", str(TRACE), "--limit", "12", "--kv", "mha:1:1:8:float16", "--quiet"]
SMALL += ["--device-tokens", "65536", "--host-tokens", "131072"]


def test_replay_with_a_secret_shows_it_nowhere(tmp_path, capsys, monkeypatch):
    secret_file = tmp_path / "secret"
    secret_file.write_text(PLANT + "\n")
    summary, events = tmp_path / "summary.json", tmp_path / "events.jsonl"
    for source in (["--secret-file", str(secret_file)], ["--secret-env", ENV]):
        monkeypatch.setenv(ENV, PLANT)
        args = ["replay", *SMALL, "--storage", "file", *source, "--encrypt-at-rest"]
        assert main([*args, "--json", str(summary), "--events", str(events)]) == 0
        out = capsys.readouterr()
        written = json.loads(summary.read_text())
        assert written["config"]["keyed_storage"] is True
        assert written["config"]["encrypt_at_rest"] is True
        for text in (out.out, out.err, summary.read_text(), events.read_text()):
            assert PLANT not in text
        assert len(events.read_text().splitlines()) > 10  # the log was written


def test_a_password_in_the_storage_spec_is_redacted_in_errors_and_json(tmp_path, capsys):
    spec = f"redis://alice:{PLANT}@127.0.0.1:1/0?connect_timeout=0.5"
    assert main(["replay", *SMALL, "--storage", spec]) == 2  # nothing listens on port 1
    err = capsys.readouterr().err
    assert "alice@127.0.0.1:1" in err and PLANT not in err
    assert main(["replay", *SMALL, "--storage", f"redis://:{PLANT}@h:1?bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and PLANT not in err
    # the summary of a run over such a store names it without the password
    cfg = CacheConfig(storage=spec, model_id="m")
    written = json.dumps(summarize(Tally(), {}, cfg, [], block_tokens=512, storage=spec, wall=1))
    assert PLANT not in written and "alice:***@127.0.0.1:1" in written


def test_a_cache_with_a_secret_stores_no_plain_page_hash(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, PLANT)
    store = tmp_path / "store"
    assert main(["replay", *SMALL, "--storage", f"file:{store}", "--secret-env", ENV]) == 0
    names = [p.name for p in store.rglob("*") if p.is_file() and len(p.name) == 64]
    assert names
    plain = tmp_path / "plain"
    assert main(["replay", *SMALL, "--storage", f"file:{plain}"]) == 0
    plain_names = {p.name for p in plain.rglob("*") if p.is_file() and len(p.name) == 64}
    assert not plain_names & set(names)
