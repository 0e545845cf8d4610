"""Backpressure through an actor system, on virtual time: a full inbox holds the sender back."""

from dataclasses import dataclass

from hicache.runtime import Actor, ActorSystem, run_deterministic


@dataclass(frozen=True, slots=True)
class Item:
    n: int


class SlowConsumer(Actor[Item]):
    """Takes one virtual second per item."""

    def __init__(self) -> None:
        super().__init__("consumer", capacity=3)
        self.got: list[tuple[int, float]] = []

    async def handle(self, msg: Item) -> None:
        await self.system.sleep(1.0)
        self.got.append((msg.n, self.system.now()))


class Producer(Actor[int]):
    """On a message `count`, sends that many items as fast as the consumer lets it."""

    def __init__(self, consumer: SlowConsumer) -> None:
        super().__init__("producer", capacity=1)
        self.consumer = consumer
        self.sent_at: list[float] = []

    async def handle(self, msg: int) -> None:
        for n in range(msg):
            await self.consumer.inbox.send(Item(n))
            self.sent_at.append(self.system.now())


def test_full_inbox_blocks_the_sender_and_delivers_in_order():
    async def main() -> tuple[SlowConsumer, Producer]:
        system = ActorSystem()
        consumer = SlowConsumer()
        producer = Producer(consumer)
        system.add(consumer)
        system.add(producer)
        async with system:
            await producer.inbox.send(10)
            await system.run_until_idle()
            stats = consumer.inbox.statistics()
            # items 3..9 each waited (item 3 only until the consumer picked up item 0)
            assert stats.high_water == 3 and stats.blocked_sends == 7
        return consumer, producer

    consumer, producer = run_deterministic(main)
    assert [n for n, _ in consumer.got] == list(range(10))  # in order, none lost
    assert [t for _, t in consumer.got] == [float(i) for i in range(1, 11)]
    # one item in the consumer's hands and three buffered go at once; then one per second
    assert producer.sent_at == [0.0] * 4 + [float(i) for i in range(1, 7)]
