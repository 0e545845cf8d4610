"""Mailbox: bounded FIFO, backpressure, reserve, close, cancellation, threads."""

import anyio
import anyio.to_thread
import pytest

from hicache.runtime import ActorSystemClosed, Mailbox


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("m", 0), {}, "capacity must be an int >= 1"),
        (("m", True), {}, "capacity must be an int >= 1"),
        (("m", 1.5), {}, "capacity must be an int >= 1"),
        (("", 1), {}, "non-empty string"),
        (("m", 1), {"reserve": -1}, "reserve must be an int >= 0"),
    ],
)
def test_bad_construction_is_rejected(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Mailbox(*args, **kwargs)


async def drain(box: Mailbox[int], n: int) -> list[int]:
    return [await box.receive() for _ in range(n)]


@pytest.mark.anyio
async def test_fifo_within_capacity():
    box: Mailbox[int] = Mailbox("m", 3)
    for i in range(3):
        await box.send(i)
    assert box.statistics().used == 3
    assert await drain(box, 3) == [0, 1, 2]
    assert box.empty()


@pytest.mark.anyio
async def test_full_mailbox_blocks_sender_then_delivers_in_order():
    box: Mailbox[int] = Mailbox("m", 2)
    sent: list[int] = []

    async def producer() -> None:
        for i in range(6):
            await box.send(i)
            sent.append(i)

    async with anyio.create_task_group() as tg:
        tg.start_soon(producer)
        await anyio.wait_all_tasks_blocked()
        stats = box.statistics()
        assert sent == [0, 1]  # the third send is waiting: backpressure
        assert (stats.used, stats.capacity, stats.waiting_senders) == (2, 2, 1)
        received = await drain(box, 6)
    assert received == list(range(6))
    assert sent == list(range(6))
    stats = box.statistics()
    assert stats.blocked_sends >= 1 and stats.high_water == 2 and stats.delivered == 6


@pytest.mark.anyio
async def test_blocked_senders_are_admitted_in_arrival_order():
    box: Mailbox[str] = Mailbox("m", 1)
    await box.send("first")
    async with anyio.create_task_group() as tg:
        for name in ("a", "b", "c"):
            tg.start_soon(box.send, name)
            await anyio.wait_all_tasks_blocked()  # pin arrival order
        assert box.statistics().waiting_senders == 3
        got = [await box.receive() for _ in range(4)]
    assert got == ["first", "a", "b", "c"]


@pytest.mark.anyio
async def test_send_nowait_uses_reserve_and_never_drops():
    box: Mailbox[int] = Mailbox("m", 1, reserve=1)
    box.send_nowait(1)
    box.send_nowait(2)  # the reserve
    with pytest.raises(anyio.WouldBlock, match="'m' is full"):
        box.send_nowait(3)
    assert await drain(box, 2) == [1, 2]
    assert box.empty()


@pytest.mark.anyio
async def test_ordinary_send_does_not_take_the_reserve():
    box: Mailbox[int] = Mailbox("m", 1, reserve=1)
    await box.send(1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(box.send, 2)
        await anyio.wait_all_tasks_blocked()
        assert box.statistics().waiting_senders == 1  # blocked although the reserve is free
        box.send_nowait(3)  # the reserve is there for a credited completion
        got = await drain(box, 3)
    assert got == [1, 3, 2]


@pytest.mark.anyio
async def test_cancelled_blocked_send_delivers_nothing_and_passes_the_turn_on():
    box: Mailbox[str] = Mailbox("m", 1)
    await box.send("x")
    async with anyio.create_task_group() as tg:
        cancel_me = anyio.CancelScope()

        async def doomed() -> None:
            with cancel_me:
                await box.send("doomed")

        tg.start_soon(doomed)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(box.send, "y")
        await anyio.wait_all_tasks_blocked()
        cancel_me.cancel()
        await anyio.wait_all_tasks_blocked()
        assert box.statistics().waiting_senders == 1
        got = [await box.receive(), await box.receive()]
    assert got == ["x", "y"]
    assert box.empty()


@pytest.mark.anyio
async def test_close_wakes_blocked_senders_and_receiver_drains():
    box: Mailbox[int] = Mailbox("m", 1)
    await box.send(1)
    errors: list[BaseException] = []

    async def blocked() -> None:
        try:
            await box.send(2)
        except ActorSystemClosed as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(blocked)
        await anyio.wait_all_tasks_blocked()
        box.close()
    assert len(errors) == 1 and "'m' is closed" in str(errors[0])
    with pytest.raises(ActorSystemClosed):
        await box.send(3)
    with pytest.raises(ActorSystemClosed):
        box.send_nowait(3)
    assert await box.receive() == 1  # buffered messages survive the close
    with pytest.raises(anyio.EndOfStream):
        await box.receive()


@pytest.mark.anyio
async def test_threadsafe_sender_delivers_from_a_worker_thread():
    box: Mailbox[int] = Mailbox("m", 2)
    deliver = box.threadsafe_sender()

    def worker() -> str:
        deliver(1)
        deliver(2)
        try:
            deliver(3)
        except anyio.WouldBlock:
            return "refused"
        return "accepted"

    assert await anyio.to_thread.run_sync(worker) == "refused"
    assert await drain(box, 2) == [1, 2]
    deliver(4)  # the loop thread itself may call it too
    assert await box.receive() == 4


@pytest.mark.anyio
async def test_a_waiting_receiver_is_woken_by_a_send_and_by_close():
    box: Mailbox[int] = Mailbox("m", 2)
    got: list[object] = []

    async def receiver() -> None:
        got.append(await box.receive())
        try:
            await box.receive()
        except anyio.EndOfStream as exc:
            got.append(type(exc))

    async with anyio.create_task_group() as tg:
        tg.start_soon(receiver)
        await anyio.wait_all_tasks_blocked()
        box.send_nowait(7)
        await anyio.wait_all_tasks_blocked()
        assert got == [7]
        box.close()
    assert got == [7, anyio.EndOfStream]
    assert box.empty()


@pytest.mark.anyio
async def test_a_cancelled_receive_loses_no_message():
    box: Mailbox[int] = Mailbox("m", 2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(box.receive)  # nothing there: it waits, and is cancelled waiting
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    box.send_nowait(1)
    box.send_nowait(2)
    assert await drain(box, 2) == [1, 2]
    assert box.statistics().used == 0


@pytest.mark.anyio
async def test_a_discarded_receiver_releases_what_was_buffered():
    box: Mailbox[int] = Mailbox("m", 3)
    box.send_nowait(1)
    box.send_nowait(2)
    box.discard_receiver()
    assert box.closed and box.empty()
    with pytest.raises(anyio.EndOfStream):
        await box.receive()
