"""Write policies: when a device-resident node should get a host (L2) copy.

- ``write_through``: back up at the first hit (a fresh insert counts as one).
- ``write_through_selective`` (default): back up at the second hit.
- ``write_back``: never on hits; a node without a host copy is backed up when L1 evicts it, and the
  eviction waits for that backup.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "WRITE_BACK",
    "WRITE_POLICIES",
    "WRITE_THROUGH",
    "WRITE_THROUGH_SELECTIVE",
    "WritePolicy",
    "write_policy",
]


@dataclass(frozen=True, slots=True)
class WritePolicy:
    name: str
    backup_threshold: int | None
    """Hit count at which a device-only node is reported for backup; None: never on hits."""

    @property
    def backup_on_evict(self) -> bool:
        """True if L1 eviction of a node without host copy must wait for a backup first."""
        return self.backup_threshold is None


WRITE_THROUGH = WritePolicy("write_through", 1)
WRITE_THROUGH_SELECTIVE = WritePolicy("write_through_selective", 2)
WRITE_BACK = WritePolicy("write_back", None)

WRITE_POLICIES: MappingProxyType[str, WritePolicy] = MappingProxyType(
    {p.name: p for p in (WRITE_THROUGH, WRITE_THROUGH_SELECTIVE, WRITE_BACK)}
)


def write_policy(name: str = "write_through_selective") -> WritePolicy:
    """The write policy by name."""
    try:
        return WRITE_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown write policy {name!r}; known: {', '.join(WRITE_POLICIES)}"
        ) from None
