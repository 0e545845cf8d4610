"""The actor runtime: mailboxes, actors, replies, the supervising actor system, clock,
deterministic mode."""

from hicache.runtime.actor import Actor
from hicache.runtime.actor_system import ActorSystem
from hicache.runtime.clock import Clock, MonotonicClock, TimerHandle
from hicache.runtime.deterministic import run_deterministic
from hicache.runtime.errors import ActorFailed, ActorSystemClosed, ActorSystemError, ReplyTimeout
from hicache.runtime.mailbox import Mailbox, MailboxStatistics
from hicache.runtime.reply import Reply

__all__ = [
    "Actor",
    "ActorFailed",
    "ActorSystem",
    "ActorSystemClosed",
    "ActorSystemError",
    "Clock",
    "Mailbox",
    "MailboxStatistics",
    "MonotonicClock",
    "Reply",
    "ReplyTimeout",
    "TimerHandle",
    "run_deterministic",
]
