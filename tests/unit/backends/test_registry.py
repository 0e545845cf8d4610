from __future__ import annotations

import sys
import types

import anyio
import pytest

from hicache.backends.memory import MemoryBackend, MemoryStore
from hicache.backends.registry import open_backend, resolve


@pytest.mark.parametrize(
    "spec, target",
    [
        ("memory", "hicache.backends.memory:MemoryBackend"),
        ("file:/tmp/x", "hicache.backends.file:FileBackend"),
        ("redis://localhost:6379/0", "hicache.backends.redis:RedisBackend"),
        ("rediss://h:1", "hicache.backends.redis:RedisBackend"),
        ("unix:///run/redis.sock", "hicache.backends.redis:RedisBackend"),
        ("redis+cluster://h:1", "hicache.backends.redis:RedisBackend"),
        ("mooncake://master:50051", "hicache.backends.mooncake:MooncakeBackend"),
        ("nixl:/data/kv?plugin=POSIX", "hicache.backends.nixl:NixlBackend"),
        ("aibrix:/data/kv", "hicache.backends.aibrix:AibrixBackend"),
        ("my_pkg.stores:FastStore", "my_pkg.stores:FastStore"),
    ],
)
def test_resolve(spec, target):
    assert resolve(spec) == target


@pytest.mark.parametrize("spec", ["", "s3", "memory:big", "http://x", "a.b:"])
def test_unknown_spec_lists_known_forms(spec):
    with pytest.raises(ValueError) as err:
        resolve(spec)
    assert "memory" in str(err.value) and "file:" in str(err.value)


def test_nixl_and_aibrix_specs_need_a_directory():
    from hicache.backends.keys import Namespace

    ns = Namespace(model="m", kv="mha:1:1:8:float16", page_size=4)
    for spec in ("nixl:", "aibrix:"):
        with pytest.raises(ValueError, match="needs a directory"):
            open_backend(spec, namespace=ns)


def test_file_spec_needs_a_directory():
    with pytest.raises(ValueError, match="needs a directory"):
        resolve("file:")


def test_open_memory_passes_options(ns):
    store = MemoryStore()
    backend = open_backend("memory", namespace=ns, store=store)
    assert isinstance(backend, MemoryBackend) and backend.store is store


def test_open_out_of_tree_class(ns, monkeypatch):
    seen = {}

    class Custom(MemoryBackend):
        @classmethod
        def from_spec(cls, spec, *, namespace, emit=None, **options):
            seen.update(spec=spec, options=options)
            return cls(namespace=namespace, emit=emit)

    class NotABackend:
        @classmethod
        def from_spec(cls, spec, **kw):
            return object()

    mod = types.ModuleType("fake_store_mod")
    mod.Custom, mod.NotABackend = Custom, NotABackend
    monkeypatch.setitem(sys.modules, "fake_store_mod", mod)
    assert isinstance(open_backend("fake_store_mod:Custom", namespace=ns, colour="blue"), Custom)
    assert seen == {"spec": "fake_store_mod:Custom", "options": {"colour": "blue"}}
    with pytest.raises(ValueError, match="has no 'Missing'"):
        open_backend("fake_store_mod:Missing", namespace=ns)
    with pytest.raises(TypeError, match="not a StorageBackend"):
        open_backend("fake_store_mod:NotABackend", namespace=ns)


def test_open_errors(ns):
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        open_backend("no_such_module_xyz:Thing", namespace=ns)
    with pytest.raises(TypeError, match="Namespace"):
        open_backend("memory", namespace="ns")


def test_connect_is_bounded_and_a_silent_store_is_closed(ns, monkeypatch):
    """A store whose `connect` never answers is `BackendUnavailable` after `connect_timeout`
    (virtual time), and is closed; one that answers is returned open."""
    from hicache.backends.base import BackendUnavailable
    from hicache.backends.registry import connect_backend
    from hicache.testing import run_virtual

    closed: list[str] = []

    async def hang(self) -> None:
        await anyio.sleep_forever()

    async def answer(self) -> None:
        await anyio.sleep(1.0)  # virtual time (run_virtual)

    async def aclose(self) -> None:
        closed.append("closed")

    monkeypatch.setattr(MemoryBackend, "aclose", aclose)

    async def silent() -> float:
        monkeypatch.setattr(MemoryBackend, "connect", hang, raising=False)
        began = anyio.current_time()
        with pytest.raises(
            BackendUnavailable, match=r"'memory' did not answer connect within 5.0 s"
        ):
            await connect_backend("memory", namespace=ns, connect_timeout=5.0)
        return anyio.current_time() - began

    assert run_virtual(silent) == pytest.approx(5.0)
    assert closed == ["closed"]

    async def answering() -> object:
        monkeypatch.setattr(MemoryBackend, "connect", answer, raising=False)
        return await connect_backend("memory", namespace=ns, connect_timeout=5.0)

    assert run_virtual(answering) is not None and closed == ["closed"]
