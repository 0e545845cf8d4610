"""Actor tests run on both anyio backends unless they pin one (deterministic tests use trio)."""

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param
