"""The tree component: the controller (controller.py), a synchronous core over the radix tree
(`hicache.radix`), the slot ledgers and every op in flight, and the actor that drives it
(actor.py)."""
