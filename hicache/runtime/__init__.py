"""The microkernel: mailboxes, actors, replies, the supervising kernel, clock, deterministic mode."""

from hicache.runtime.actor import Actor
from hicache.runtime.clock import Clock, MonotonicClock, TimerHandle
from hicache.runtime.deterministic import run_deterministic
from hicache.runtime.errors import ActorFailed, KernelClosed, KernelError, ReplyTimeout
from hicache.runtime.kernel import Kernel
from hicache.runtime.mailbox import Mailbox, MailboxStatistics
from hicache.runtime.reply import Reply

__all__ = [
    "Actor",
    "ActorFailed",
    "Clock",
    "Kernel",
    "KernelClosed",
    "KernelError",
    "Mailbox",
    "MailboxStatistics",
    "MonotonicClock",
    "Reply",
    "ReplyTimeout",
    "TimerHandle",
    "run_deterministic",
]
