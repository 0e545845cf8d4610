"""Observability: the structured event log (JSON lines), test capture, and setup."""

from hicache.observability.capture import capture_events
from hicache.observability.configure import configure_logging
from hicache.observability.events import BoundEvents, EventLog

__all__ = ["BoundEvents", "EventLog", "capture_events", "configure_logging"]
