"""Removing a replay's scratch store (`remove_tree`): everything under it goes, shard
directories by a few threads at once, and links are removed without being followed."""

from __future__ import annotations

import os
from pathlib import Path

from hicache.cli.replay import exit as replay_exit
from hicache.cli.replay.exit import remove_tree


def make_store(root: Path, shards: int = 12, files: int = 5) -> int:
    """A replay's scratch directory: root/store/<namespace>/<shard>/<leaf>/<value>, plus an
    owner file and the store's temporary directory."""
    made = 0
    for s in range(shards):
        leaf = root / "store" / "ns" / f"{s:02x}" / "a"
        leaf.mkdir(parents=True)
        for f in range(files):
            (leaf / f"v{f}").write_bytes(b"x" * 64)
            made += 1
    (root / "store" / "ns" / "tmp").mkdir()
    (root / ".owner").write_text("1\n")
    return made + 1


def test_everything_under_the_store_goes(tmp_path, monkeypatch):
    removed: list[str] = []
    rmtree = replay_exit.shutil.rmtree

    def counting(path, *args, **kwargs):
        removed.append(os.fspath(path))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(replay_exit, "_REMOVE_THREADS", 3)
    monkeypatch.setattr(replay_exit.shutil, "rmtree", counting)
    store = tmp_path / "store"
    assert make_store(store) == 61
    shards = sorted(str(p) for p in (store / "store" / "ns").iterdir())
    assert len(shards) == 13
    remove_tree(store)
    assert not store.exists()
    # each shard directory (and tmp) on its own, then what is left
    assert sorted(removed[:-1]) == shards
    assert removed[-1] == str(store)


def test_links_are_removed_not_followed(tmp_path):
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "keep").write_bytes(b"k")
    store = tmp_path / "store"
    make_store(store, shards=3)
    (store / "store" / "ns" / "link").symlink_to(outside, target_is_directory=True)
    (store / "top-link").symlink_to(outside / "deep", target_is_directory=True)
    remove_tree(store)
    assert not store.exists()
    assert (outside / "deep" / "keep").read_bytes() == b"k"


def test_a_missing_or_flat_directory_is_fine(tmp_path):
    remove_tree(tmp_path / "never-made")  # nothing to do, no error
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "one").write_bytes(b"1")
    remove_tree(flat)
    assert not flat.exists()
