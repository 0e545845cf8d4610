"""The controller: a synchronous core (controller.py) over the radix tree (`hicache.radix`),
the slot ledgers and every op in flight, and the actor that drives it (actor.py, the actor
system's `tree`)."""
