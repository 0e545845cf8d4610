"""The allocator actor: owns the device and host slot ledgers. A leaf: it answers, never asks."""

from __future__ import annotations

from typing_extensions import assert_never

from hicache.components.allocator.core import LedgerError, SlotLedger
from hicache.messages import Alloc, AllocatorInbox, Free, LedgerStats
from hicache.runtime import Actor


class AllocatorActor(Actor[AllocatorInbox]):
    def __init__(self, *, device: SlotLedger, host: SlotLedger, capacity: int) -> None:
        super().__init__("allocator", capacity=capacity)
        self._ledgers = {"device": device, "host": host}

    async def handle(self, msg: AllocatorInbox) -> None:
        match msg:
            case Alloc(tier=tier, num_tokens=n, reply=reply):
                try:
                    reply.set(self._ledgers[tier].alloc(n))
                except LedgerError as exc:  # a bad request fails the asker, not the ledger
                    reply.fail(exc)
            case Free(tier=tier, slots=slots):
                if len(slots):
                    self._ledgers[tier].free(slots)
            case LedgerStats(reply=reply):
                reply.set(
                    {
                        tier: {"size": led.size, "used": led.used, "available": led.available}
                        for tier, led in self._ledgers.items()
                    }
                )
            case _:
                assert_never(msg)
