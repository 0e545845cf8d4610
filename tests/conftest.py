"""Shared test configuration."""


def pytest_addoption(parser):
    group = parser.getgroup("hicache simulation (tests/sim)")
    group.addoption(
        "--sim-seed",
        type=int,
        default=None,
        metavar="N",
        help="run only this seed of the whole-cache simulation (tests/sim)",
    )
    group.addoption(
        "--sim-mode",
        choices=("virtual", "thread"),
        default=None,
        help="with --sim-seed: deterministic virtual time (default) or real "
        "CPU transfer threads on asyncio",
    )
    group.addoption(
        "--sim-seeds",
        type=int,
        default=None,
        metavar="COUNT",
        help="how many seeds tests/sim runs (default 1000 deterministic + 10 threaded)",
    )


def pytest_report_header(config):
    """Where the test kit's pools live (HICACHE_TEST_DEVICE, hicache.testing.devices)."""
    from hicache.testing.devices import pool_device

    kit, why = pool_device("auto")
    sim, _ = pool_device("cpu")
    return [f"hicache test pools: virtual_config on {kit}, simulation on {sim} ({why})"]
