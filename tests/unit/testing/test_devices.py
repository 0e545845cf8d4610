"""HICACHE_TEST_DEVICE: where the test kit puts the cache's pools."""

from __future__ import annotations

import pytest

from hicache.kernels import streams
from hicache.testing import virtual_config
from hicache.testing.devices import ENV, pool_device
from hicache.testing.simulation.config import random_config


@pytest.fixture
def cuda_here(monkeypatch):
    """A stand-in driver answer: CUDA usable or not, whatever this machine has."""

    def answer(usable):
        monkeypatch.setattr(
            streams, "cuda_driver_status", lambda: (usable, "stand-in driver answer")
        )

    return answer


def test_unset_keeps_each_kits_default(monkeypatch, cuda_here):
    monkeypatch.delenv(ENV, raising=False)
    cuda_here(True)
    assert pool_device("auto")[0] == "auto" and pool_device("cpu")[0] == "cpu"
    assert virtual_config().device == "auto"


@pytest.mark.parametrize("asked", ["cuda", "cuda:1", "auto"])
def test_cuda_where_usable_else_the_cpu_with_the_reason(monkeypatch, cuda_here, asked):
    monkeypatch.setenv(ENV, asked)
    cuda_here(True)
    want = "cuda" if asked == "auto" else asked
    assert pool_device("cpu")[0] == want
    assert virtual_config().device == want
    assert random_config(3).cache["device"] == want  # the simulation's pools too
    cuda_here(False)
    device, why = pool_device("auto")
    assert device == "cpu" and "stand-in driver answer" in why and ENV in why
    assert virtual_config().device == "cpu"


def test_a_value_it_does_not_know_is_named(monkeypatch):
    monkeypatch.setenv(ENV, "tpu")
    with pytest.raises(ValueError, match="HICACHE_TEST_DEVICE='tpu'"):
        pool_device("cpu")
    monkeypatch.setenv(ENV, "cpu")
    assert virtual_config().device == "cpu"
