"""Reply: one-shot semantics."""

import pytest

from hicache.runtime import Reply


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.anyio
async def test_set_then_wait_returns_value():
    reply: Reply[int] = Reply()
    assert not reply.done
    reply.set(7)
    assert reply.done
    assert await reply.wait() == 7


@pytest.mark.anyio
async def test_fail_makes_wait_raise():
    reply: Reply[int] = Reply()
    reply.fail(LookupError("gone"))
    with pytest.raises(LookupError, match="gone"):
        await reply.wait()


@pytest.mark.anyio
async def test_one_shot_rules():
    reply: Reply[int] = Reply()
    reply.set(1)
    with pytest.raises(RuntimeError, match="already set"):
        reply.set(2)
    reply.fail(ValueError("late"))  # ignored: first outcome wins
    assert reply.result() == 1

    abandoned: Reply[int] = Reply()
    abandoned.fail(TimeoutError("gave up"))
    abandoned.set(5)  # a late answer after the requester gave up is ignored, not an error
    with pytest.raises(TimeoutError):
        abandoned.result()


@pytest.mark.anyio
async def test_on_done_called_once_and_bad_fail_rejected():
    seen: list[Reply[int]] = []
    reply: Reply[int] = Reply(on_done=seen.append)
    with pytest.raises(RuntimeError, match="pending"):
        reply.result()
    with pytest.raises(TypeError, match="needs an exception"):
        reply.fail("not an exception")  # type: ignore[arg-type]
    assert not reply.done
    reply.set(3)
    reply.fail(ValueError())
    assert seen == [reply]
