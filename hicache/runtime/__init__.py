"""The microkernel: mailboxes, actors, replies, the supervising kernel, clock, deterministic mode."""

from hicache.runtime.actor import Actor
from hicache.runtime.clock import Clock, MonotonicClock
from hicache.runtime.credits import Credits
from hicache.runtime.deterministic import run_deterministic
from hicache.runtime.errors import ActorFailed, KernelClosed, KernelError, ReplyTimeout
from hicache.runtime.kernel import Kernel, TimerHandle
from hicache.runtime.mailbox import Mailbox, MailboxStatistics
from hicache.runtime.reply import Reply

__all__ = [
    "Actor",
    "ActorFailed",
    "Clock",
    "Credits",
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
