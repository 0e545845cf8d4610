"""Where test pools live: `HICACHE_TEST_DEVICE` moves the cache's pools in the test kit
(`virtual_config`, the simulation) onto a GPU, so the whole cache, not only the kernels, is
exercised on CUDA by the same tests that run on a CPU.

Values: unset (the kit's defaults: `virtual_config` says "auto", the simulation "cpu"), "cpu",
"cuda", "cuda:N" or "auto". A CUDA value on a machine with no usable CUDA falls back to the CPU,
with the reason (the test session prints it in its header)."""

from __future__ import annotations

import os

ENV = "HICACHE_TEST_DEVICE"


def pool_device(default: str) -> tuple[str, str]:
    """(device for the test kit's pools, why). `default` applies when the variable is unset.
    Raises ValueError naming the variable for a value it does not know."""
    asked = os.environ.get(ENV, "").strip()
    if not asked:
        return default, f"{ENV} unset: the kit's default ({default})"
    if asked == "cpu":
        return "cpu", f"{ENV}=cpu"
    if asked == "auto" or asked == "cuda" or asked.startswith("cuda:"):
        from hicache.kernels.streams import cuda_driver_status

        usable, why = cuda_driver_status()
        if usable:
            return ("cuda" if asked == "auto" else asked), f"{ENV}={asked}: {why}"
        if asked == "auto":
            return "cpu", f"{ENV}=auto: {why}"
        return "cpu", f"{ENV}={asked} but CUDA is unusable ({why}): pools stay on the CPU"
    raise ValueError(f"{ENV}={asked!r}: expected cpu, cuda, cuda:N or auto")
